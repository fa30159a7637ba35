"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import fused_kernels


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim in float32, cast back, then scale by `weight`.

    In float32 there is no cast, and torch's fused `F.rms_norm` gives the same bits in one
    op instead of six, which is faster."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


class RMSNorm(nn.Module, fused_kernels.CpuOpsUser):
    """`forward(x)` -> normed x; `forward(x, residual)` -> (normed(x + residual), x + residual).

    The native path is the numerical reference and the CPU path. On CUDA, when a fused-op
    provider was found (sgl-kernel or FlashInfer, see `fused_kernels`), its `rmsnorm` /
    `fused_add_rmsnorm` run instead; the fused add works in place:
    afterwards `x` holds the normed output and `residual` the sum (when they are
    contiguous), which is what the decoder layers want. On CPU the compiled ops given by
    `fused_kernels.enable_cpu_ops` run the same two calls, for float32 and bfloat16.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_impl(x, residual)

    def forward_impl(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused_kernels.use_fused(x):
            return self._forward_fused(fused_kernels.fused_ops(), x, residual)
        tensors = (x, self.weight) if residual is None else (x, residual, self.weight)
        if (ops := fused_kernels.cpu_ops_for(self, *tensors)) is not None:
            return self._forward_fused(ops, x, residual)
        if residual is None:
            return rms_norm_native(x, self.weight, self.variance_epsilon)
        summed = x + residual
        return rms_norm_native(summed, self.weight, self.variance_epsilon), summed

    def _forward_fused(
        self, ops: Any, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()  # the kernels take [tokens, hidden]
        weight = self.weight.data
        if residual is None:
            return ops.rmsnorm(rows, weight, self.variance_epsilon).view(shape)
        res_rows = residual.reshape(-1, shape[-1]).contiguous()
        ops.fused_add_rmsnorm(rows, res_rows, weight, self.variance_epsilon)
        return rows.view(shape), res_rows.view(shape)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
