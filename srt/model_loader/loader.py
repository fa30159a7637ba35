"""Turn a ``--model-path`` into a loaded ``torch.nn.Module`` and a tokenizer.

Steps: ``resolve_model_path`` (None -> default GGUF; ``.gguf`` -> converted HF folder; HF
folder -> itself), ``ModelConfig.from_path``, then ``get_model`` builds the class from
``srt.models.registry`` and streams HF-named tensors into its ``load_weights``.
No model hub is ever contacted. Under tensor parallelism every rank reads the full tensors
and its layers' loaders keep the rank's part (mmap'd safetensors make the reads cheap).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from srt.layers.weight_utils import full_shape, take_full
from srt.model_loader.default_model import ModelNotFoundError, find_default_gguf
from srt.model_loader.gguf_convert import convert_gguf
from srt.model_loader.hf_cache import cached_snapshot, hub_cache_dir, looks_like_repo_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from srt.configs.model_config import ModelConfig
    from srt.distributed import TPGroup

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
DUMMY_SEED = 1234
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> str:
    """A local HF-format folder for ``model_path``: a folder, a GGUF file (converted once),
    or a model id (`Org/Name`) already in the local Hugging Face cache (`hf_cache.py`)."""
    if model_path is None:
        return str(convert_gguf(find_default_gguf(), cache_dir))
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path, cache_dir))
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(convert_gguf(ggufs[0], cache_dir))
        hint = f" It holds {len(ggufs)} .gguf files; pass one of them." if ggufs else ""
        raise ModelNotFoundError(f"{path} is a folder without config.json.{hint}")
    if looks_like_repo_id(model_path):
        snapshot = cached_snapshot(model_path)
        if snapshot is not None:
            return str(snapshot)
        raise ModelNotFoundError(
            f"Model {model_path!r} is not in the local Hugging Face cache ({hub_cache_dir()}; "
            "set HF_HOME or HF_HUB_CACHE to look elsewhere), and RadixRT never downloads from "
            f"a model hub: run `huggingface-cli download {model_path}` first, or pass a folder."
        )
    raise ModelNotFoundError(
        f"Model path {model_path!r} is neither a local HF folder (with config.json), a .gguf "
        "file, nor a model id in the local Hugging Face cache. RadixRT never downloads from a "
        "model hub: download the model first (e.g. `huggingface-cli download <repo> "
        "--local-dir <dir>`) and pass the folder."
    )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    # Some repos ship both consolidated.safetensors and model*.safetensors with the same
    # tensors under different names; the HF-named files are the ones we want.
    hf_named = [f for f in files if not f.name.startswith("consolidated")]
    return hf_named or files


def iterate_safetensors(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor in the folder's safetensors files."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = _safetensors_files(Path(folder))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {folder}")
    # A bar per checkpoint shard, on a terminal only (tqdm's disable=None: not in logs).
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=None):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def init_dummy_weights(model: torch.nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every floating parameter with uniform(-1e-3, 1e-3) noise, deterministically.

    A tensor-parallel shard draws its full (tp=1) tensor and keeps its part, so the numbers
    are those of the tp=1 model whatever the tp size (the parameter order is the same).
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
                generators[param.device] = gen
            shape = full_shape(param)
            if shape == tuple(param.shape):
                param.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)
                continue
            full = torch.empty(shape, dtype=param.dtype, device=param.device)
            param.copy_(take_full(param, full.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)))


def get_model(
    model_config: ModelConfig,
    load_format: str = "auto",
    device: str = "cpu",
    tp: TPGroup | None = None,
) -> torch.nn.Module:
    """Build ``model_config``'s architecture in its dtype on ``device`` and load weights.

    ``auto`` / ``safetensors`` read the folder's safetensors; ``dummy`` fills random values
    so benchmarks can run any config.json without weights. ``tp`` (None: one device) builds
    this rank's shard of the model.
    """
    from srt.models.registry import get_model_class

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
    cls = get_model_class(model_config.architectures)
    start = time.perf_counter()
    with _default_dtype(model_config.dtype), torch.device(device):
        # tp=None keeps the one-argument call, which classes without tensor parallelism
        # (and test doubles) implement.
        model = cls(model_config.hf_config) if tp is None else cls(model_config.hf_config, tp=tp)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        model.load_weights(iterate_safetensors(model_config.model_path))
    model.eval()
    model.requires_grad_(False)
    num_params = sum(p.numel() for p in model.parameters())
    shard = f", TP rank {tp.rank} of {tp.size}" if tp is not None and tp.size > 1 else ""
    logger.info(
        "Loaded %s (%.1fM params%s, %s, %s, load_format=%s) in %.2f s",
        cls.__name__,
        num_params / 1e6,
        shard,
        model_config.dtype,
        device,
        load_format,
        time.perf_counter() - start,
    )
    return model


def get_tokenizer(
    path: str, tokenizer_path: str | None = None, cache_dir: str | None = None
) -> PreTrainedTokenizerBase:
    """The local tokenizer of ``tokenizer_path`` (a folder, a .gguf, or a model id in the
    local Hugging Face cache) or else of ``path``."""
    from transformers import AutoTokenizer

    source = tokenizer_path or path
    if source.endswith(".gguf") and Path(source).is_file():
        source = str(convert_gguf(source, cache_dir))
    elif looks_like_repo_id(source) and (snapshot := cached_snapshot(source)) is not None:
        source = str(snapshot)
    return AutoTokenizer.from_pretrained(source, local_files_only=True)
