"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim in float32, cast back, then scale by `weight`."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


class RMSNorm(nn.Module):
    """`forward(x)` -> normed x; `forward(x, residual)` -> (normed(x + residual), x + residual).

    The native path is the numerical reference. `forward_impl` is the single place a fused
    device kernel (e.g. sgl-kernel's fused_add_rmsnorm) plugs in later.
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
        if residual is None:
            return rms_norm_native(x, self.weight, self.variance_epsilon)
        summed = x + residual
        return rms_norm_native(summed, self.weight, self.variance_epsilon), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
