"""How parameters receive checkpoint tensors, and how a tensor-parallel shard is cut.

Every parameter may carry a `weight_loader(param, loaded_weight[, shard_id])` attribute; a
model's `load_weights` calls it with the tensor from the checkpoint. Parameters without one
use `default_weight_loader` (shape-checked copy, dtype cast to the parameter's).

A parameter that holds only this rank's part of a tensor-parallel layer records the full
(tp=1) shape and how to cut its part from a full tensor (`set_tp_take`). The default loader
and the dummy initialiser (`model_loader.loader.init_dummy_weights`) read full tensors and
keep this rank's part through `take_full`, so checkpoints and random weights are the same
whatever the tp size. Parameters that hold the whole tensor (every one at tp=1) record
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

TakeFn = Callable[[torch.Tensor], torch.Tensor]


def set_tp_take(param: nn.Parameter, full_shape: Sequence[int], take: TakeFn) -> None:
    """Record that `param` holds `take(full)` of a full tensor of `full_shape`. A parameter
    already of the full shape holds all of it (every part is a contiguous range), so nothing
    is recorded and tp=1 keeps its plain path."""
    if tuple(full_shape) == tuple(param.shape):
        return
    param.tp_full_shape = tuple(full_shape)  # type: ignore[attr-defined]
    param.tp_take = take  # type: ignore[attr-defined]


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The shape of the whole tensor `param` is (a part of)."""
    return getattr(param, "tp_full_shape", tuple(param.shape))


def take_full(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a tensor of `full_shape(param)`."""
    take: TakeFn | None = getattr(param, "tp_take", None)
    return full if take is None else take(full)


def _check_shape(what: str, got: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(got.shape) != tuple(expected):
        raise ValueError(
            f"{what} of shape {tuple(got.shape)} does not fit a parameter of shape "
            f"{tuple(expected)}"
        )


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (keeping this rank's part of it)."""
    _check_shape("checkpoint tensor", loaded_weight, full_shape(param))
    with torch.no_grad():
        param.copy_(take_full(param, loaded_weight))


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
