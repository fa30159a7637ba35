"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import fused_kernels


class SiluAndMul(nn.Module, fused_kernels.CpuOpsUser):
    """x = [gate | up] along the last dim -> silu(gate) * up.

    The fused provider's `silu_and_mul` on CUDA (sgl-kernel or FlashInfer, see
    `fused_kernels`; both need rows of a multiple of 16 bytes), the compiled CPU op for 2-D
    CPU rows when the module was given it (`fused_kernels.enable_cpu_ops`); the torch code
    otherwise.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels.use_fused(x):
            if (x.shape[-1] * x.element_size()) % 16 == 0:
                return fused_kernels.fused_ops().silu_and_mul(x.contiguous())
        elif (ops := fused_kernels.cpu_ops_for(self, x)) is not None:
            return ops.silu_and_mul(x)
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] along the last dim -> gelu_tanh(gate) * up (Gemma's GeGLU, HF's
    `gelu_pytorch_tanh`). The torch code everywhere: no fused op computes it yet."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]
