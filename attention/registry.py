"""Attention backends by name, imported lazily so GPU-only packages stay optional."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attention.base import AttentionBackend

# name -> (module, class, pip package the module needs or None). GPU backends (flashinfer)
# register here with the package they need, which is only imported when one is chosen.
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "torch_native": ("attention.torch_native_backend", "TorchNativeAttnBackend", None),
    "flashinfer": ("attention.flashinfer_backend", "FlashInferAttnBackend", "flashinfer"),
}

# FlashInfer has fp16 / bf16 kernels only.
_FLASHINFER_DTYPES = ("float16", "bfloat16")


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def is_package_installed(name: str) -> bool:
    """Whether `name` can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


def resolve_attention_backend(name: str, device: str, dtype: torch.dtype | str) -> str:
    """`--attention-backend auto` -> flashinfer on CUDA with fp16/bf16 when it is installed,
    else torch_native. Any other name is returned as is."""
    if name != "auto":
        return name
    dtype_name = str(dtype).removeprefix("torch.")
    if (
        device.startswith("cuda")
        and dtype_name in _FLASHINFER_DTYPES
        and is_package_installed("flashinfer")
    ):
        return "flashinfer"
    return "torch_native"


def create_attention_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Build the backend registered as `name`; kwargs go to its constructor."""
    try:
        module_name, class_name, requirement = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_attention_backends()}"
        ) from None
    if requirement is not None and not is_package_installed(requirement):
        raise ImportError(
            f"attention backend {name!r} needs the {requirement!r} package, which is not "
            f"installed (pip install 'radixrt[gpu]'); use --attention-backend torch_native"
        )
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(**kwargs)
