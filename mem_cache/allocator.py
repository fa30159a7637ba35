"""The paged token allocator: the single owner of free KV slots.

Pages are numbered 1..num_pages; page 0 (slots 0..page_size-1) is the dummy page that
padding writes target and is never handed out. Slot = page * page_size + offset.

Ownership: a page is either in this free list or owned by someone else (a radix-tree node,
or a running request's not-yet-cached tail). `alloc*` moves pages out, `free` moves them
back. Nothing may be freed twice; `mem_cache.integrity.check_memory_integrity` proves it.
With page_size > 1 a request's token at position p lives at offset p % page_size of its
page, so extending into a partially filled last page reuses the slots after `last_loc`
instead of taking a new page.

`free_group_begin()` / `free_group_end()` batch the frees of one scheduler step into a
single concatenation.

The free list always lives on the CPU (bookkeeping, not data); returned slots are moved to
`device`, and freed slots are brought back to the CPU.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)
_MAX_RELEASED_CHUNKS = 512  # merge released chunks eagerly past this many


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        # Free pages live in a head tensor plus a list of released chunks that is merged
        # into the head only when an alloc needs it, so free() is O(1).
        self._free_pages: torch.Tensor = _EMPTY
        self._released: list[torch.Tensor] = []
        self._released_count = 0
        self._in_free_group = False
        self._free_group: list[torch.Tensor] = []
        self.clear()

    # -- bookkeeping -------------------------------------------------------------------

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released = []
        self._released_count = 0
        self._in_free_group = False
        self._free_group = []

    def total_size(self) -> int:
        """Usable token slots (excludes the dummy page)."""
        return self.size

    def available_size(self) -> int:
        return (len(self._free_pages) + self._released_count) * self.page_size

    def num_free_pages(self) -> int:
        return len(self._free_pages) + self._released_count

    def free_pages(self) -> torch.Tensor:
        """Page ids currently in the free list (a copy; order is unspecified)."""
        return torch.cat((self._free_pages, *self._released))

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = torch.cat((self._free_pages, *self._released))
            self._released = []
            self._released_count = 0

    # -- alloc -------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (page_size 1 only), or None and nothing taken."""
        assert self.page_size == 1, "alloc() is for page_size 1; use alloc_extend/decode"
        if need_size > len(self._free_pages):
            if need_size > self.num_free_pages():
                return None
            self._merge_released()
        out = self._free_pages[:need_size]
        self._free_pages = self._free_pages[need_size:]
        return self._out(out)

    def _out(self, slots: torch.Tensor) -> torch.Tensor:
        return slots if self._on_cpu else slots.to(self.device, non_blocking=True)

    def _take_pages(self, n: int) -> torch.Tensor:
        if n > len(self._free_pages):
            self._merge_released()
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        return pages

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions prefix_len..seq_len-1 of each request, concatenated."""
        ps = self.page_size
        if ps == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        plan: list[tuple[int, int, int]] = []  # (reused slots, first reused slot, new tokens)
        pages_needed = 0
        for prefix_len, seq_len, last_loc in zip(prefix_lens, seq_lens, last_locs):
            extend = seq_len - prefix_len
            if extend < 0:
                raise ValueError(f"seq_len {seq_len} < prefix_len {prefix_len}")
            in_page = prefix_len % ps
            reuse = min(ps - in_page, extend) if in_page else 0
            fresh = extend - reuse
            plan.append((reuse, last_loc + 1, fresh))
            pages_needed += -(-fresh // ps)
        if pages_needed > self.num_free_pages():
            return None
        pages = self._take_pages(pages_needed)
        fresh_slots = (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)
        parts: list[torch.Tensor] = []
        cursor = 0  # into fresh_slots; each request starts on a page boundary
        for reuse, first_reused, fresh in plan:
            if reuse:
                parts.append(torch.arange(first_reused, first_reused + reuse, dtype=torch.int64))
            if fresh:
                parts.append(fresh_slots[cursor : cursor + fresh])
                cursor += -(-fresh // ps) * ps
        return self._out(torch.cat(parts) if parts else _EMPTY.clone())

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len-1 (seq_lens include the new token)."""
        ps = self.page_size
        if ps == 1:
            return self.alloc(len(seq_lens))
        positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
        out = torch.tensor(last_locs, dtype=torch.int64) + 1
        new_page = positions % ps == 0
        n_new = int(new_page.sum())
        if n_new > self.num_free_pages():
            return None
        if n_new:
            out[new_page] = self._take_pages(n_new) * ps
        return self._out(out)

    # -- free --------------------------------------------------------------------------

    def free(self, indices: torch.Tensor) -> None:
        """Return slots (page_size 1) or the pages containing them (page_size > 1)."""
        if indices.numel() == 0:
            return
        if self._in_free_group:
            self._free_group.append(indices)
            return
        indices = indices.to(device="cpu", dtype=torch.int64)
        if self.page_size == 1:
            pages = indices
        else:
            pages = torch.unique(indices // self.page_size)
        self._released.append(pages)
        self._released_count += len(pages)
        if len(self._released) >= _MAX_RELEASED_CHUNKS:
            self._merge_released()

    def free_group_begin(self) -> None:
        self._in_free_group = True

    def free_group_end(self) -> None:
        self._in_free_group = False
        if self._free_group:
            group, self._free_group = self._free_group, []
            self.free(torch.cat(group))
