"""Attention backends by name, imported lazily so GPU-only packages stay optional."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.utils.lazy import lazy_exports
from srt.utils.registry import Registry, is_package_installed

if TYPE_CHECKING:
    import torch

    from attention.base import AttentionBackend
    from attention.radix_attention import attention_layers

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "attention_layers",
    "available_attention_backends",
    "create_attention_backend",
    "is_package_installed",
    "resolve_attention_backend",
]

# For type hints and the model's layer scan elsewhere (`srt/` reaches attention only through
# this module), imported on first use: the HTTP server reads the backend names here without
# importing torch.
__getattr__ = lazy_exports(
    __name__,
    {"AttentionBackend": "attention.base", "attention_layers": "attention.radix_attention"},
)

# GPU backends register with the package they need, which is only imported when one is chosen.
ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
ATTENTION_BACKENDS.register("torch_native", "attention.torch_native_backend:TorchNativeAttnBackend")
ATTENTION_BACKENDS.register("cpu", "attention.cpu_backend:CpuAttnBackend")
ATTENTION_BACKENDS.register(
    "flashinfer",
    "attention.flashinfer_backend:FlashInferAttnBackend",
    requires="flashinfer",
    hint="pip install 'radixrt[gpu]', or use --attention-backend torch_native",
)

# FlashInfer has fp16 / bf16 kernels only.
_FLASHINFER_DTYPES = ("float16", "bfloat16")


def available_attention_backends() -> list[str]:
    return ATTENTION_BACKENDS.names()


# Backends whose kernels honour a layer's sliding window (`RadixAttention.sliding_window`).
WINDOWED_BACKENDS = ("torch_native", "cpu", "flashinfer")


def resolve_attention_backend(
    name: str, device: str, dtype: torch.dtype | str, sliding_window: int | None = None
) -> str:
    """`--attention-backend auto` -> flashinfer on CUDA with fp16/bf16 when it is installed,
    cpu on a CPU, else torch_native. Any other name is returned as is, unless the model has
    a window its kernels do not honour (a ValueError: they would attend past the window and
    give wrong tokens without a word)."""
    if name != "auto":
        if sliding_window is not None and name not in WINDOWED_BACKENDS:
            raise ValueError(
                f"--attention-backend {name} does not support sliding-window attention (this "
                f"model's window is {sliding_window} tokens); use one of "
                f"{', '.join(WINDOWED_BACKENDS)}"
            )
        return name
    dtype_name = str(dtype).removeprefix("torch.")
    if (
        device.startswith("cuda")
        and dtype_name in _FLASHINFER_DTYPES
        and is_package_installed("flashinfer")
    ):
        return "flashinfer"
    if device == "cpu":
        return "cpu"
    return "torch_native"


def create_attention_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Build the backend registered as `name`; kwargs go to its constructor."""
    return ATTENTION_BACKENDS.create(name, **kwargs)
