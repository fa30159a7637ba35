"""How parameters receive checkpoint tensors.

Every parameter may carry a `weight_loader(param, loaded_weight[, shard_id])` attribute; a
model's `load_weights` calls it with the tensor from the checkpoint. Parameters without one
use `default_weight_loader` (shape-checked copy, dtype cast to the parameter's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit a "
            f"parameter of shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


def copy_into_shard(
    param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int, name: str
) -> None:
    """Copy `loaded_weight` into rows [offset, offset + size) of `param` (dim 0)."""
    expected = (size, *param.shape[1:])
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(
            f"shard {name!r}: checkpoint tensor of shape {tuple(loaded_weight.shape)}, "
            f"expected {expected}"
        )
    with torch.no_grad():
        param.narrow(0, offset, size).copy_(loaded_weight)


def set_weight_loader(param: nn.Parameter, loader: Callable[..., Any]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> Callable[..., Any]:
    return getattr(param, "weight_loader", default_weight_loader)
