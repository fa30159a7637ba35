"""Memory pools: request rows and per-layer KV storage.

Ownership:
- `ReqToTokenPool` hands out rows of `req_to_token` (one per running request). `KVManager`
  takes a row when a request is first allocated KV and frees it when the request finishes or
  is retracted. A row's entries are KV slot indices of that request's token positions; which
  of those slots the request owns (versus the radix tree) is tracked by its `KVSpan`
  (`protected_len`), not here.
- `MHATokenToKVPool` only stores K/V. It never decides who owns a slot: the
  `TokenToKVPoolAllocator` (allocator.py) owns the free list. Page 0 (slots
  0..page_size-1) is a dummy that padded writes may target and that is never allocated.

On a CPU the K/V buffers start as zeros without being written: each is a fresh anonymous
mapping, which the OS zero-fills a page at a time on first touch (`lazy_zeros`). A server
with the default 6 GiB pool starts seconds sooner and holds only the pages its slots used.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from srt.utils.device_memory import device_memory

logger = logging.getLogger(__name__)


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """`torch.zeros(shape)`, and on a CPU without writing it: a tensor over a fresh anonymous
    mapping, whose pages read as zeros and are backed by memory only once touched (the
    tensor keeps the mapping alive). Other devices get `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class ReqToTokenPool:
    """`int32[size, max_context_len]` map from (request row, token position) to KV slot.

    On a GPU the table lives twice: `req_to_token` on the device, which attention reads, and
    `host`, a mirror that `KVManager` reads and writes (the bookkeeping never waits for the
    device). The device copy is written on the device, from data staged with each batch
    (`srt/model_executor/step_inputs.py`): the batch's own new slots (its rows, positions and
    `out_cache_loc`), plus the ranges `KVManager` rewrote outside a batch (a matched prefix
    copied into a new row, a row pointed at the tree's slots), which `log` records and the
    next launch drains (`take_logged`). On a CPU both names are the same tensor and nothing
    is logged."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.mirrored = device_memory(device).separate
        self._host = torch.zeros_like(self.req_to_token, device="cpu") if self.mirrored else None
        self._logged: list[tuple[int, int, int]] = []  # (row, start, stop) since the last drain
        self._free_rows: list[int] = list(range(size))
        # Overlap loop: a forward still in flight may read a row its request just gave up, so
        # freed rows are held until the scheduler knows that forward is done (`release`).
        self.hold_frees = False
        self._held: list[int] = []

    @property
    def host(self) -> torch.Tensor:
        """The table the host reads and writes: the mirror on a GPU, the table on a CPU."""
        return self._host if self._host is not None else self.req_to_token

    def log(self, row: int, start: int, stop: int) -> None:
        """Record that host positions [start, stop) of `row` changed outside a batch's own
        new tokens; the next launch copies them to the device (a no-op on a CPU)."""
        if self.mirrored and stop > start:
            self._logged.append((row, start, stop))

    def take_logged(self) -> tuple[list[int], list[int], torch.Tensor] | None:
        """(rows, columns, slots) of every logged position, read from the host table now (so
        a position logged twice carries its latest value both times), or None; clears the
        log."""
        if not self._logged:
            return None
        logged, self._logged = self._logged, []
        rows: list[int] = []
        cols: list[int] = []
        for row, start, stop in logged:
            rows.extend([row] * (stop - start))
            cols.extend(range(start, stop))
        host = self.host
        slots = torch.cat([host[row, start:stop] for row, start, stop in logged])
        return rows, cols, slots

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take `n` rows, or None (taking nothing) when fewer are free."""
        if n > len(self._free_rows):
            return None
        rows = self._free_rows[:n]
        self._free_rows = self._free_rows[n:]
        return rows

    def free(self, idx: int | list[int]) -> None:
        rows = [idx] if isinstance(idx, int) else list(idx)
        (self._held if self.hold_frees else self._free_rows).extend(rows)

    def take_held(self) -> list[int]:
        """The rows freed since the last call (they stay unavailable until `release`)."""
        held, self._held = self._held, []
        return held

    def release(self, rows: list[int]) -> None:
        self._free_rows.extend(rows)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
        self._held = []
        self._logged = []


class MHATokenToKVPool:
    """Per layer one K and one V buffer of `[size + page_size, head_num, head_dim]`."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.size = size // page_size * page_size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        rows = self.size + page_size  # + the dummy page 0
        shape = (rows, head_num, head_dim)
        self.k_buffer: list[torch.Tensor] = [
            lazy_zeros(shape, dtype, device) for _ in range(layer_num)
        ]
        self.v_buffer: list[torch.Tensor] = [
            lazy_zeros(shape, dtype, device) for _ in range(layer_num)
        ]
        logger.info(
            "KV pool: %d token slots, page_size=%d, %d layers, %.2f MiB",
            self.size,
            page_size,
            layer_num,
            self.get_kv_size_bytes() / (1 << 20),
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> None:
        """Write `cache_k/cache_v` (`[T, head_num, head_dim]`) at slots `loc` (`[T]`)."""
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
        if cache_v.dtype != self.dtype:
            cache_v = cache_v.to(self.dtype)
        self.k_buffer[layer_id][loc] = cache_k
        self.v_buffer[layer_id][loc] = cache_v

    def get_kv_size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))
