"""sgl-kernel's fused CUDA ops, used by the layers when installed and the tensors are on CUDA.

Every layer keeps its torch code as the fallback (CPU, or no sgl-kernel) and as the
numerical reference. `sgl_kernel` is imported on the first CUDA call that can use it,
never at import time, so importing the model code never pulls in a GPU package.

The ops (sgl-kernel >= 0.1): `rmsnorm(x, w, eps)` -> new tensor; `fused_add_rmsnorm(x, r,
w, eps)` in place (r += x, then x = rmsnorm(r)); `silu_and_mul(x)` -> new tensor (last
dim * itemsize a multiple of 16 bytes); `apply_rope_with_cos_sin_cache_inplace(positions,
q, k, head_size, cos_sin_cache, is_neox)` in place, float32 cache rows `[cos | sin]`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

import torch

# The kernels are instantiated for half types only; float32 models keep the torch code.
FUSED_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def sgl_kernel_installed() -> bool:
    return importlib.util.find_spec("sgl_kernel") is not None


@functools.cache
def sgl_kernel() -> ModuleType:
    return importlib.import_module("sgl_kernel")


def use_fused(x: torch.Tensor) -> bool:
    """Take the sgl-kernel path for `x`? CUDA fp16/bf16 tensors, when it is installed."""
    return x.is_cuda and x.dtype in FUSED_DTYPES and sgl_kernel_installed()
