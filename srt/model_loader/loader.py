"""Turn a resolved model folder into a loaded ``torch.nn.Module``.

Steps: ``sources.resolve_model_path`` (None -> default GGUF; ``.gguf`` -> converted HF folder;
HF folder -> itself), ``ModelConfig.from_path``, then ``get_model`` builds the class from
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

if TYPE_CHECKING:
    from srt.configs.model_config import ModelConfig
    from srt.distributed import TPGroup

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
DUMMY_SEED = 1234
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3


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
    embedding: bool = False,
    quantization: str = "none",
) -> torch.nn.Module:
    """Build ``model_config``'s architecture in its dtype on ``device`` and load weights.

    ``auto`` / ``safetensors`` read the folder's safetensors; ``dummy`` fills random values
    so benchmarks can run any config.json without weights. ``tp`` (None: one device) builds
    this rank's shard of the model. ``embedding``: the model only pools hidden states, so
    its checkpoint may lack the LM head. ``quantization`` (resolved: none, gguf, int8 or
    int4) keeps the linear weights quantized (`srt.layers.quantization`).
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
        weights = iterate_safetensors(model_config.model_path)
        if quantization == "gguf":
            from srt.model_loader.gguf_quant import attach_gguf_blocks, gguf_source

            source = gguf_source(model_config.model_path)
            if source is None:
                raise ValueError("--quantization gguf needs a model converted from a .gguf file")
            weights = attach_gguf_blocks(weights, source, Path(model_config.model_path))
        if embedding:
            model.load_weights(weights, need_lm_head=False)
        else:
            model.load_weights(weights)
    model.eval()
    model.requires_grad_(False)
    if quantization != "none":
        from srt.layers.quantization import quantize_model

        quantize_model(model, quantization)
    num_params = sum(p.numel() for p in model.parameters())
    shard = f", TP rank {tp.rank} of {tp.size}" if tp is not None and tp.size > 1 else ""
    logger.info(
        "Loaded %s (%.1fM params%s, %s, %s, load_format=%s, quantization=%s) in %.2f s",
        cls.__name__,
        num_params / 1e6,
        shard,
        model_config.dtype,
        device,
        load_format,
        quantization,
        time.perf_counter() - start,
    )
    return model
