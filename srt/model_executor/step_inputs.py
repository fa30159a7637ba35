"""`StepStager`: a batch's host-side inputs reach the device in one copy.

A forward reads a handful of small integer arrays: per new token its id, position and KV slot;
per request its `req_to_token` row and length (and for a prefill its prefix and new lengths);
the rows that get logits; the output index each sampled row draws at. Built one tensor at a
time, each is an allocation and a blocking copy, and the GPU waits through all of them. Here
they are packed, as int64, into one host buffer and sent with one non-blocking copy into a
device buffer the forward reads views of:

    host (pinned, two buffers used in turn)  ──one copy──▶  device buffer ──views──▶ ForwardBatch

A decode batch that a CUDA graph replays is packed straight into the graph's static inputs:
the graph of padded size P reads five fields at fixed offsets of `graph_buffer` (ids,
positions, slots, rows, lengths, each P long, padding included), so the staging copy is the
only copy (`GraphInputs`). Everything else goes to a general buffer that grows as needed.

Device-side work done here, in stream order after the copy, so the host never waits:
- the device's `req_to_token` gets the batch's new slots (rows, positions, `out_cache_loc`)
  and the ranges `KVManager` rewrote since the last launch (`ReqToTokenPool.log`);
- future token ids (negative placeholders of the overlap loop) are replaced by the ids a
  forward already launched sampled into the future buffer.

A pinned buffer is written again two steps later, after waiting for the event recorded when
its copy was queued (in practice long done: the host runs at most one step ahead). On a CPU
(`DeviceMemory.separate` False) the host buffer is the device buffer and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from srt.utils.device_memory import DeviceMemory, Event, wait

# The fields a decode CUDA graph reads, in their order in `graph_buffer` (each P long).
GRAPH_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
# Padding rows of a graph batch: token 0 at position 0 into the dummy slot 0, reading one
# token of row 0 (whatever that row holds is a valid slot; the result is discarded).
GRAPH_PADDING = {"seq_lens": 1}
# Room after a graph's fields for the step's other data (sampling positions, logged table
# writes), per request of the largest graph, plus a fixed reserve.
GRAPH_EXTRA_PER_REQ = 4
GRAPH_EXTRA_RESERVE = 3 * 4096
MIN_GENERAL = 1 << 14


@dataclass(slots=True)
class FutureSlots:
    """Where a launched forward writes its sampled ids: `buffer[first : first + n]`, on the
    device. Later batches name them by the placeholder `-(first + i)`."""

    buffer: torch.Tensor
    first: int


class Pack:
    """Named int64 fields laid out one after another, written into a host buffer at send."""

    def __init__(self) -> None:
        self.fields: list[tuple[str, Any, int, int]] = []  # (name, values, length, pad)
        self.size = 0

    def add(self, name: str, values: Any, length: int | None = None, pad: int = 0) -> None:
        """`values`: a list, numpy array or host tensor; `length` (>= len) pads with `pad`."""
        n = len(values) if length is None else length
        self.fields.append((name, values, n, pad))
        self.size += n

    def write(self, host: np.ndarray) -> dict[str, tuple[int, int]]:
        """Write every field into `host`; return name -> (offset, length)."""
        spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, values, n, pad in self.fields:
            k = len(values)
            if isinstance(values, torch.Tensor):
                host[offset : offset + k] = values.numpy()
            elif k:
                host[offset : offset + k] = values
            if n > k:
                host[offset + k : offset + n] = pad
            spans[name] = (offset, n)
            offset += n
        return spans


class GraphInputs:
    """The static inputs of the decode graphs: for padded size P, `GRAPH_FIELDS` at offsets
    0, P, 2P, ... of one device buffer, which the stager fills directly."""

    def __init__(self, max_bs: int, memory: DeviceMemory) -> None:
        self.max_bs = max_bs
        capacity = len(GRAPH_FIELDS) * max_bs + GRAPH_EXTRA_PER_REQ * max_bs + GRAPH_EXTRA_RESERVE
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=memory.device)

    def views(self, padded_bs: int) -> dict[str, torch.Tensor]:
        return {
            name: self.buffer[k * padded_bs : (k + 1) * padded_bs]
            for k, name in enumerate(GRAPH_FIELDS)
        }

    def pad(self, padded_bs: int, start: int = 0) -> None:
        """Make rows start .. padded_bs of the graph of size padded_bs padding."""
        for name, view in self.views(padded_bs).items():
            view[start:].fill_(GRAPH_PADDING.get(name, 0))

    def fill(self, fields: dict[str, torch.Tensor], padded_bs: int) -> None:
        """Copy a batch staged elsewhere into the graph's inputs (a batch not staged for a
        graph, e.g. built by a test): one device copy per field."""
        bs = len(fields["seq_lens"])
        for name, view in self.views(padded_bs).items():
            view[:bs].copy_(fields[name], non_blocking=True)
        self.pad(padded_bs, bs)


class StepStager:
    def __init__(self, memory: DeviceMemory, graph_inputs: GraphInputs | None = None) -> None:
        self.memory = memory
        self.graph_inputs = graph_inputs
        self.general = torch.zeros(MIN_GENERAL, dtype=torch.int64, device=memory.device)
        self.host: list[torch.Tensor] = []
        self.host_np: list[np.ndarray] = []
        self.copied: list[Event | None] = []
        if memory.separate:
            for _ in range(2):
                self._add_host(MIN_GENERAL)
        self.turn = 0

    def _add_host(self, n: int, index: int | None = None) -> None:
        buf = self.memory.host_buffer(n, torch.int64)
        if index is None:
            self.host.append(buf)
            self.host_np.append(buf.numpy())
            self.copied.append(None)
        else:
            self.host[index], self.host_np[index] = buf, buf.numpy()

    def fits_graph(self, pack: Pack) -> bool:
        """Whether a pack laid out for a graph (its fields first) fits the graph buffer."""
        return self.graph_inputs is not None and pack.size <= len(self.graph_inputs.buffer)

    def send(self, pack: Pack, graph_bs: int | None = None) -> dict[str, torch.Tensor]:
        """Write `pack` and make it visible on the device; return its fields as device views.
        `graph_bs`: the pack starts with `GRAPH_FIELDS` padded to that size and goes into the
        graph buffer (the caller checked it fits: `fits_graph`)."""
        if graph_bs is not None:
            assert self.graph_inputs is not None
            target = self.graph_inputs.buffer
        else:
            if pack.size > len(self.general):
                self.general = torch.zeros(
                    max(pack.size, 2 * len(self.general)),
                    dtype=torch.int64,
                    device=self.memory.device,
                )
            target = self.general
        if self.memory.separate:
            spans = self._copy(pack, target)
        else:
            spans = pack.write(target.numpy())
        return {name: target[o : o + n] for name, (o, n) in spans.items()}

    def _copy(self, pack: Pack, target: torch.Tensor) -> dict[str, tuple[int, int]]:
        turn = self.turn
        self.turn ^= 1
        wait(self.copied[turn])  # the copy that last read this buffer was queued 2 steps ago
        if pack.size > len(self.host[turn]):
            self._add_host(max(pack.size, 2 * len(self.host[turn])), turn)
        spans = pack.write(self.host_np[turn])
        self.memory.to_device(target[: pack.size], self.host[turn][: pack.size])
        self.copied[turn] = self.memory.record()
        return spans


def write_on_device(pool: Any, staged: dict[str, torch.Tensor], count: int, decode: bool) -> None:
    """Write the device's `req_to_token` from staged data (nothing on a CPU, where
    `KVManager` wrote the one table): first the ranges logged since the last launch, then
    the batch's `count` new tokens (a decode's rows are its requests' rows)."""
    if not pool.mirrored:
        return
    table = pool.req_to_token
    if "logged_rows" in staged:
        table[staged["logged_rows"], staged["logged_cols"]] = staged["logged_slots"].to(table.dtype)
    rows = staged["req_pool_indices" if decode else "token_rows"][:count]
    table[rows, staged["positions"][:count]] = staged["out_cache_loc"][:count].to(table.dtype)


def resolve_future_ids(input_ids: torch.Tensor, future: torch.Tensor) -> None:
    """Replace, in place and on the device, each placeholder `-(slot)` in `input_ids` by
    `future[slot]`, the id a forward launched earlier sampled there (stream order makes
    sure it has)."""
    slots = input_ids.neg().clamp_(min=0)
    input_ids.copy_(torch.where(input_ids < 0, future[slots], input_ids))
