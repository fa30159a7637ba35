"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
