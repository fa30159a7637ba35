"""Linear layers, single device. Merged layers run several projections as one matmul.

`QKVLinear` holds q, k and v projections stacked on the output dim and `MergedColumnLinear`
any list of projections (the MLP's gate and up). Their `weight_loader(param, w, shard_id)`
places HF's separate `q_proj` / `k_proj` / `v_proj` (shard ids "q", "k", "v") or
`gate_proj` / `up_proj` (shard ids 0, 1) into the merged weight and bias.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.cpu_packed import PackableLinear
from srt.layers.weight_utils import copy_into_shard, default_weight_loader, set_weight_loader


class LinearBase(PackableLinear):
    """y = x @ W.T + b with W [output_size, input_size] (a oneDNN-packed copy of W on CPU,
    once `pack_for_cpu` ran: see `srt/layers/cpu_packed.py`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        for param in self._params():
            set_weight_loader(param, self.weight_loader)

    def _params(self) -> list[nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards (got {shard_id!r})")
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer."""


class RowLinear(LinearBase):
    """Input-dim-split linear in tensor parallelism (o_proj, down_proj); one device here."""


class MergedColumnLinear(LinearBase):
    """Several projections of the same input concatenated on the output dim."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already merged checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id])
        copy_into_shard(param, loaded_weight, offset, self.output_sizes[shard_id], str(shard_id))


class QKVLinear(LinearBase):
    """q, k and v projections in one matmul; output = [q (H*D) | k (Hkv*D) | v (Hkv*D)]."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        """(offset, size) of shard "q", "k" or "v" on the output dim."""
        ranges = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in ranges:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return ranges[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_range(str(shard_id))
        copy_into_shard(param, loaded_weight, offset, size, str(shard_id))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
