"""Linear layers, plain or split over tensor-parallel ranks.

`QKVLinear` holds q, k and v projections stacked on the output dim and `MergedColumnLinear`
any list of projections (the MLP's gate and up). Their `weight_loader(param, w, shard_id)`
places HF's separate `q_proj` / `k_proj` / `v_proj` (shard ids "q", "k", "v") or
`gate_proj` / `up_proj` (shard ids 0, 1) into the merged weight and bias.

Tensor parallelism (`tp`, a `TPGroup`; size 1 by default, which is the plain layer):
- column-parallel (`MergedColumnLinear`, `QKVLinear`): each rank holds some output rows of
  every projection (a balanced range, or its attention heads from a `HeadLayout`) and
  returns its part of the output; no communication.
- row-parallel (`RowLinear`): each rank holds some input columns, multiplies its part of the
  input and the ranks' partial sums are all-reduced; the bias is added once, after.
Loaders take the full checkpoint tensors and keep this rank's rows or columns; every sharded
parameter also records its full shape and its cut (`weight_utils.set_tp_take`).
"""

from __future__ import annotations

import torch
from torch import nn

from srt.distributed import HeadLayout, TPGroup, balanced_range
from srt.kernels.quant import QuantBlocks
from srt.layers.cpu_packed import PackedWeight, apply_linear
from srt.layers.quantization import QuantizedWeight, record_blocks
from srt.layers.weight_utils import (
    TakeFn,
    copy_into_shard,
    default_weight_loader,
    set_tp_take,
    set_weight_loader,
)


def _narrow_rows(
    loaded: torch.Tensor, full_rows: int, rows: tuple[int, int], name: str
) -> torch.Tensor:
    """Rows [start, end) of a checkpoint tensor that must have `full_rows` rows."""
    if loaded.dim() == 0 or loaded.shape[0] != full_rows:
        raise ValueError(
            f"shard {name!r}: checkpoint tensor of shape {tuple(loaded.shape)}, "
            f"expected {full_rows} rows"
        )
    return loaded.narrow(0, rows[0], rows[1] - rows[0])


def _take_rows(full_offsets: list[int], rows: list[tuple[int, int]]) -> TakeFn:
    """The cut of a column-parallel parameter: from each projection of the full merged
    tensor (projection i starts at row `full_offsets[i]`), its local rows `rows[i]`."""
    parts = [
        (off + start, end - start) for off, (start, end) in zip(full_offsets, rows, strict=True)
    ]

    def take(full: torch.Tensor) -> torch.Tensor:
        return torch.cat([full.narrow(0, start, n) for start, n in parts])

    return take


class LinearBase(nn.Module):
    """y = x @ W.T + b with W [output_size, input_size], this rank's sizes. On CPU,
    `pack_for_cpu` keeps packed copies of W in `packed` (see `srt/layers/cpu_packed.py`), or
    W is kept quantized in `quant` (`srt/layers/quantization.py`; the dense parameter is then
    a meta tensor)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        self.packed: PackedWeight | None = None
        self.quant: QuantizedWeight | None = None
        for param in self._params():
            set_weight_loader(param, self.weight_loader)

    def pack_for_cpu(self) -> bool:
        """Pack the weight for the CPU matmuls; False where it cannot be packed (or is kept
        quantized)."""
        if self.quant is not None:
            return False
        self.packed = PackedWeight.pack(self.weight)
        return self.packed is not None

    def linear(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x @ weight.T (+ bias unless `add_bias` is False: a row-parallel layer adds it once,
        after summing the ranks' partial products)."""
        if self.quant is not None:
            return self.quant.linear(x, add_bias)
        return apply_linear(x, self.weight, self.bias if add_bias else None, self.packed)

    def _params(self) -> list[nn.Parameter]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards (got {shard_id!r})")
        default_weight_loader(param, loaded_weight)
        if param is self.weight:
            record_blocks(self, None, 0, loaded_weight, self._rank_blocks)

    def _rank_blocks(self, blocks: QuantBlocks) -> QuantBlocks:
        """This rank's part of a whole checkpoint weight's blocks, cut as `take_full` cuts
        the tensor (every cut of a column-parallel or replicated layer is of rows)."""
        take = getattr(self.weight, "tp_take", None)
        return blocks if take is None else blocks.map_rows(take)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer (the whole weight on every rank)."""


class RowLinear(LinearBase):
    """Input-dim-split linear (o_proj, down_proj): this rank holds input columns
    `input_range` (by default its balanced share of `input_size`), takes the matching part
    of the input, and the partial products are summed over the ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        input_range: tuple[int, int] | None = None,
    ) -> None:
        self.tp = tp or TPGroup.single()
        if input_range is None:
            input_range = balanced_range(input_size, self.tp.size, self.tp.rank)
        start, end = input_range
        if not 0 <= start <= end <= input_size:
            raise ValueError(f"input range {input_range} outside [0, {input_size})")
        self.full_input_size = input_size
        self.input_range = input_range
        super().__init__(end - start, output_size, bias)
        # The bias is replicated: only the weight is cut (dim 1).
        set_tp_take(self.weight, (output_size, input_size), self._take_columns)

    def _take_columns(self, full: torch.Tensor) -> torch.Tensor:
        start, end = self.input_range
        return full.narrow(1, start, end - start)

    def _rank_blocks(self, blocks: QuantBlocks) -> QuantBlocks:
        return blocks.columns(*self.input_range)  # a ValueError where a block is split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.linear(x)
        out = self.tp.all_reduce(self.linear(x, add_bias=False))
        return out if self.bias is None else out.add_(self.bias)


class MergedColumnLinear(LinearBase):
    """Several projections of the same input concatenated on the output dim; each rank holds
    its balanced share of every projection, `[part of 0 | part of 1 | ...]`."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        self.tp = tp or TPGroup.single()
        self.full_output_sizes = list(output_sizes)
        self.output_rows = [balanced_range(n, self.tp.size, self.tp.rank) for n in output_sizes]
        self.output_sizes = [end - start for start, end in self.output_rows]
        super().__init__(input_size, sum(self.output_sizes), bias)
        full_offsets = [sum(self.full_output_sizes[:i]) for i in range(len(output_sizes))]
        take = _take_rows(full_offsets, self.output_rows)
        for param in self._params():
            set_tp_take(param, (sum(self.full_output_sizes), *param.shape[1:]), take)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already merged checkpoint tensor
            default_weight_loader(param, loaded_weight)
            if param is self.weight:
                record_blocks(self, None, 0, loaded_weight, self._rank_blocks)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        name = str(shard_id)
        rows = _narrow_rows(
            loaded_weight, self.full_output_sizes[shard_id], self.output_rows[shard_id], name
        )
        offset = sum(self.output_sizes[:shard_id])
        copy_into_shard(param, rows, offset, self.output_sizes[shard_id], name)
        if param is self.weight:
            cut = slice(*self.output_rows[shard_id])
            record_blocks(self, shard_id, offset, loaded_weight, lambda b: b.rows(cut))


class QKVLinear(LinearBase):
    """q, k and v projections in one matmul; output = [q (H*D) | k (Hkv*D) | v (Hkv*D)] for
    this rank's heads (`layout`; None holds every head). A KV head replicated on several
    ranks is loaded identically on each."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        layout: HeadLayout | None = None,
    ) -> None:
        if layout is None:
            layout = HeadLayout((0, num_heads), (0, num_kv_heads), replicated_kv=False)
        self.layout = layout
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = layout.num_heads  # this rank's
        self.num_kv_heads = layout.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        q_rows = (layout.q_heads[0] * head_dim, layout.q_heads[1] * head_dim)
        kv_rows = (layout.kv_heads[0] * head_dim, layout.kv_heads[1] * head_dim)
        # checkpoint rows per shard id: (rows in the full q/k/v tensor, this rank's range)
        self._rows = {"q": (full_q, q_rows), "k": (full_kv, kv_rows), "v": (full_kv, kv_rows)}
        take = _take_rows([0, full_q, full_q + full_kv], [q_rows, kv_rows, kv_rows])
        for param in self._params():
            set_tp_take(param, (full_q + 2 * full_kv, *param.shape[1:]), take)

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        """(offset, size) of shard "q", "k" or "v" on this rank's output dim."""
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
            if param is self.weight:
                record_blocks(self, None, 0, loaded_weight, self._rank_blocks)
            return
        name = str(shard_id)
        offset, size = self.shard_range(name)
        full_rows, rows = self._rows[name]
        copy_into_shard(
            param, _narrow_rows(loaded_weight, full_rows, rows, name), offset, size, name
        )
        if param is self.weight:
            record_blocks(self, name, offset, loaded_weight, lambda b: b.rows(slice(*rows)))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
