"""Convert a GGUF file, once, into an HF-format folder in the RadixRT cache.

Layout: ``<cache>/gguf/<stem>-<key>/`` with ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja`` and ``radixrt_gguf.json`` (the source fingerprint). The key hashes
the file name, size, mtime and target dtype, so an edited or replaced file is reconverted.

The folder is built in a temporary sibling and renamed into place, so a crash never leaves
a half-written folder behind; a file lock keeps two processes from converting at once.
HF modeling classes are used here only to dequantize and un-permute tensors; they never run
in the serving forward path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from srt import environ
from srt.model_loader.gguf_config import restore_config

if TYPE_CHECKING:  # torch is imported only to convert: finding a converted folder needs none
    import torch

logger = logging.getLogger(__name__)

MARKER_FILE = "radixrt_gguf.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Bump when what a conversion writes changes, so old conversions are not reused.
FORMAT_VERSION = 2


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: the argument, else ``$RADIXRT_CACHE_DIR``, else ``~/.cache/radixrt``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return environ.cache_root()


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def _fingerprint(gguf_path: Path, dtype: torch.dtype | None) -> dict[str, object]:
    st = gguf_path.stat()
    return {
        "source": str(gguf_path),
        "name": gguf_path.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": _dtype_name(dtype),
        "format_version": FORMAT_VERSION,
    }


def converted_folder(
    gguf_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Where ``gguf_path`` converts to (whether or not it has been converted yet)."""
    path = Path(gguf_path).resolve()
    fp = _fingerprint(path, dtype)
    key_src = "|".join(str(fp[k]) for k in ("name", "size", "mtime_ns", "dtype", "format_version"))
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{path.stem}-{key}"


def is_converted(folder: Path) -> bool:
    return (folder / MARKER_FILE).is_file() and (folder / "config.json").is_file()


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Return the HF folder for ``gguf_path``, converting it first if needed.

    float32 (the default, None) keeps the dequantized values exact; the runtime casts at load time.
    """
    path = Path(gguf_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    final = converted_folder(path, cache_dir, dtype)
    if is_converted(final):
        logger.info("Using converted GGUF folder %s", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if is_converted(final):  # another process finished while we waited
            return final
        _remove_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is shared like any other
        try:
            start = time.perf_counter()
            logger.info("Converting %s to an HF folder (one-time, %s)", path, dtype)
            with _gguf_read_once():
                _write_hf_folder(path, tmp, _torch_dtype(dtype))
            seconds = time.perf_counter() - start
            marker = dict(_fingerprint(path, dtype), seconds=round(seconds, 2))
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():  # incomplete leftover from a manual copy: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("Converted GGUF %s -> %s in %.1f s", path.name, final, seconds)
    return final


def _torch_dtype(dtype: torch.dtype | None) -> torch.dtype:
    import torch

    return torch.float32 if dtype is None else dtype


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(final: Path) -> None:
    # Safe only under the lock: any temp folder left now belongs to a crashed conversion.
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        logger.warning("Removing half-written conversion %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Inside: `gguf.GGUFReader` parses each file once and `gguf.get_tensor_name_map` builds
    each map once. transformers reads the file three times (config, tokenizer, weights),
    each a full parse of every metadata field (the vocabulary and merges token by token),
    and rebuilds the tensor-name map once per module of the model; both are pure, so sharing
    them changes nothing but the time a first start takes (`python -m bench.gguf_convert`
    measures it). transformers imports both names from `gguf` at call time, so replacing the
    module's attributes for the duration reaches it."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _write_hf_folder(gguf_path: Path, out: Path, dtype: torch.dtype) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
        # Before the model is built: some of what it restores sizes the weights.
        restore_config(config, gguf.GGUFReader(gguf_path))
        model, loading = AutoModelForCausalLM.from_pretrained(
            src_dir,
            gguf_file=name,
            config=config,
            dtype=dtype,
            local_files_only=True,
            output_loading_info=True,
        )
    except (ValueError, KeyError, NotImplementedError) as e:
        raise RuntimeError(
            f"transformers could not read {gguf_path} (unsupported GGUF architecture or "
            f"quantization?): {e}"
        ) from e
    _refuse_missing_weights(gguf_path, loading["missing_keys"])

    save_file(_untied_state_dict(model, dtype), str(out / "model.safetensors"), {"format": "pt"})

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are dequantized now
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    config.dtype = dtype
    if not config.architectures:
        config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

    tokenizer.save_pretrained(out)
    _ensure_chat_template(gguf_path, out, tokenizer.chat_template)
    del model


def _refuse_missing_weights(gguf_path: Path, missing: list[str]) -> None:
    """transformers starts a weight the file lacks at random and only logs it; served, the
    model would answer noise."""
    if missing:
        shown = ", ".join(sorted(missing)[:4]) + (" ..." if len(missing) > 4 else "")
        raise RuntimeError(
            f"{gguf_path.name} holds no tensor for {len(missing)} weight(s) of the model "
            f"transformers builds from its metadata ({shown}): its GGUF reader does not know "
            "this variant of the file's architecture (Mixtral, which llama.cpp writes as a "
            "Llama with experts, is one). Serve the model's HF folder instead."
        )


def _untied_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights as the model's HF checkpoints lay them out, which is what the loaders
    read, with aliases of one storage (tied embeddings) written once.

    transformers fuses some weights as it loads them (a MoE layer's experts into one tensor)
    and splits them back as it saves, but keeps no record of that for a model read from a
    GGUF file; cleared, the record is rebuilt from the model's class, as for a new model."""
    from transformers.core_model_loading import revert_weight_conversion

    model._weight_conversions = None
    state_dict = revert_weight_conversion(model, model.state_dict())
    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr() + tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            logger.debug("Skipping tied tensor %s", name)
            continue
        seen.add(key)
        t = tensor.detach()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return tensors


def read_gguf_chat_template(gguf_path: str | os.PathLike[str]) -> str | None:
    """The ``tokenizer.chat_template`` string from GGUF metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _ensure_chat_template(gguf_path: Path, out: Path, template: str | None) -> None:
    """Make sure the chat template is on disk, both as a .jinja file and in tokenizer_config."""
    if template is None:
        template = read_gguf_chat_template(gguf_path)
        if template is None:
            logger.warning("%s has no chat template", gguf_path.name)
            return
        logger.info("Copied the chat template from GGUF metadata (transformers dropped it)")
    jinja = out / CHAT_TEMPLATE_FILE
    if not jinja.is_file():
        jinja.write_text(template, encoding="utf-8")
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    if "chat_template" not in tok_cfg:
        # Older readers only look in tokenizer_config.json.
        tok_cfg["chat_template"] = template
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
