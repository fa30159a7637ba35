"""`KVManager`: the one owner of KV slots. Nothing outside `mem_cache/` allocates or frees.

It holds the three pieces of KV memory and moves slots between them:

    allocator (free pages) ──allocate_extend / allocate_decode / preallocate──▶ a request's span
          ▲                                                                        │
          │ evict (unlocked leaves)      cache_finished / cache_unfinished: insert │
          └──────────── prefix tree (locked while a running request uses it) ◀─────┘
                         release_uncached: a span's slots straight back (never cached)

A request's KV is a `KVSpan` (its `req_to_token` row, and which of the row's positions are
tree-owned versus its own). The manager reads only the span, the token ids its slots hold and
its `extra_key` (`KVOwner`); it never sees the rest of the request. The prefix tree maps ids to
slots and returns what it evicts; it never sees a request or the allocator.

Every table read and write here goes to the host table (`ReqToTokenPool.host`): on a GPU the
device's copy is written on the device from each launched batch, so no bookkeeping step waits
for a forward in flight (memory_pool.py).

With a tree that does not share (`ChunkCache`, `--disable-radix-cache`), a request keeps all
its slots until it finishes and then frees them; nothing is inserted.

Quarantine (disaggregated decode): slots announced to a prefill server that may still write
into them are held here, owned by no request and not free, until the caller releases them.

Integrity (`check_integrity`): every page is owned by exactly one of the free list, a tree
node, a span's own positions or the quarantine, and
`free + evictable + protected + own + quarantined == total`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mem_cache.integrity import check_memory_integrity, token_usage

if TYPE_CHECKING:
    from mem_cache.allocator import TokenToKVPoolAllocator
    from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
    from mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)


class OutOfKVError(RuntimeError):
    """An allocation the scheduler's budgets said would fit did not (a budgeting bug)."""


@dataclass(slots=True)
class KVSpan:
    """One request's KV: positions [0, protected_len) are tree slots kept alive by a lock on
    `last_node`; positions [protected_len, allocated_len) are slots the request owns."""

    row: int | None = None  # its row of req_to_token while it holds KV
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)  # this round's prefix
    last_node: Any = None  # the locked tree node ending the prefix
    protected_len: int = 0
    allocated_len: int = 0

    def prefix_len(self) -> int:
        return len(self.prefix_indices)

    def set_match(self, match: MatchResult) -> None:
        self.prefix_indices = match.device_indices
        self.last_node = match.last_node

    def clear(self) -> None:
        self.row = None
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.protected_len = 0
        self.allocated_len = 0


class KVOwner(Protocol):
    """What the manager reads of a request."""

    kv: KVSpan
    extra_key: str | None

    def kv_token_ids(self) -> list[int]:
        """The token ids whose KV the span's allocated positions hold."""
        ...


class KVManager:
    def __init__(
        self,
        rows: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree: BasePrefixCache,
    ) -> None:
        self.rows = rows
        self.allocator = allocator
        self.tree = tree
        self.page_size = allocator.page_size
        self.total_tokens = allocator.total_size()
        self.max_rows = rows.size
        # Slots a peer may still write into, by the caller's key (see "quarantine" below).
        self.quarantined: dict[Hashable, torch.Tensor] = {}

    # ---- sizes ---------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots an allocation can get: free, or evictable from the tree."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def used_tokens(self) -> int:
        return self.total_tokens - self.allocator.available_size()

    def token_usage(self) -> float:
        """Fraction of slots neither free nor evictable (0.0 .. 1.0)."""
        return token_usage(self.allocator, self.tree)

    def free_rows(self) -> int:
        return self.rows.available_size()

    # ---- admission -----------------------------------------------------------------
    def match_prefix(self, key: list[int], extra_key: str | None) -> MatchResult:
        return self.tree.match_prefix(key, extra_key)

    def tree_root(self) -> Any:
        """The tree's root node, or None for a tree that does not share."""
        return getattr(self.tree, "root_node", None)

    def lock(self, span: KVSpan) -> int:
        """Keep the span's matched prefix from eviction; return the change in available."""
        return self.tree.inc_lock_ref(span.last_node)

    def unlock(self, span: KVSpan) -> int:
        return self.tree.dec_lock_ref(span.last_node)

    # ---- allocation ----------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Move at least `num_tokens` (if the tree has them) from the tree to the free list."""
        slots = self.tree.evict(num_tokens)
        self.allocator.free(slots)
        return len(slots)

    def _make_room(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.evict(short)

    def _last_locs(self, spans: Sequence[KVSpan], lens: Sequence[int]) -> list[int]:
        """Slot of position len-1 of each span (-1 when len == 0), which the allocator
        extends a partly filled last page from: one gather over the host table for the whole
        batch. With page_size 1 the allocator takes any free slot and never reads these, so the
        table is not read at all (-1s)."""
        if self.page_size == 1 or not lens:
            return [-1] * len(lens)
        table = self.rows.host
        lens_t = torch.tensor(lens, dtype=torch.int64)
        rows = torch.tensor(
            [s.row if n > 0 else 0 for s, n in zip(spans, lens, strict=True)], dtype=torch.int64
        )
        cols = (lens_t - 1).clamp_(min=0)
        last = table[rows, cols].to(torch.int64)
        return torch.where(lens_t > 0, last, -1).tolist()

    def allocate_extend(self, spans: Sequence[KVSpan], seq_lens: Sequence[int]) -> torch.Tensor:
        """Slots for positions prefix_len..seq_len-1 of each span, concatenated.

        A span without a row gets one, with its matched prefix written in and locked prefix
        positions recorded as tree-owned."""
        table = self.rows.host
        new = [s for s in spans if s.row is None]
        rows = self.rows.alloc(len(new)) if new else []
        if rows is None:
            raise OutOfKVError("no free req_to_token rows")
        for span, row in zip(new, rows, strict=True):
            span.row = row
            n = span.prefix_len()
            if n:
                table[row, :n] = span.prefix_indices.to(table.dtype)
                self.rows.log(row, 0, n)
            span.protected_len = n
        prefix_lens = [s.prefix_len() for s in spans]
        extend = sum(seq_lens) - sum(prefix_lens)
        self._make_room(extend + len(spans) * (self.page_size - 1))
        loc = self.allocator.alloc_extend(
            prefix_lens, list(seq_lens), self._last_locs(spans, prefix_lens)
        )
        if loc is None:
            raise OutOfKVError(f"cannot allocate {extend} KV slots for prefill")
        offset = 0
        for span, p, s in zip(spans, prefix_lens, seq_lens, strict=True):
            table[span.row, p:s] = loc[offset : offset + s - p].to(table.dtype)
            offset += s - p
            span.allocated_len = s
        return loc

    def decode_tokens_needed(self, spans: Iterable[KVSpan]) -> int:
        """Slots the next decode step of these spans takes (whole pages when page_size > 1)."""
        if self.page_size == 1:
            return sum(1 for _ in spans)
        return self.page_size * sum(1 for s in spans if s.allocated_len % self.page_size == 0)

    def allocate_decode(self, spans: Sequence[KVSpan]) -> torch.Tensor:
        """One slot per span, for position allocated_len."""
        lens = [s.allocated_len for s in spans]
        self._make_room(self.decode_tokens_needed(spans))
        loc = self.allocator.alloc_decode([n + 1 for n in lens], self._last_locs(spans, lens))
        if loc is None:
            raise OutOfKVError("cannot allocate KV slots for decode")
        table = self.rows.host
        rows = torch.tensor([s.row for s in spans], dtype=torch.int64)
        table[rows, torch.tensor(lens, dtype=torch.int64)] = loc.to(table.dtype)
        for span in spans:
            span.allocated_len += 1
        return loc

    def allocate_verify(self, spans: Sequence[KVSpan], counts: Sequence[int]) -> torch.Tensor:
        """`counts[i]` slots per span, for positions allocated_len on: a verify step's last
        token and drafts (`trim` gives back the rejected ones)."""
        lens = [s.allocated_len for s in spans]
        grown = [n + c for n, c in zip(lens, counts, strict=True)]
        self._make_room(sum(counts) + len(spans) * (self.page_size - 1))
        loc = self.allocator.alloc_extend(lens, grown, self._last_locs(spans, lens))
        if loc is None:
            raise OutOfKVError(f"cannot allocate {sum(counts)} KV slots for a verify step")
        table = self.rows.host
        offset = 0
        for span, n, g in zip(spans, lens, grown, strict=True):
            table[span.row, n:g] = loc[offset : offset + g - n].to(table.dtype)
            offset += g - n
            span.allocated_len = g
        return loc

    def trim(self, span: KVSpan, length: int) -> None:
        """Shrink the span to its first `length` positions, freeing the slots past them (a
        verify step's rejected drafts). With pages, a page that still holds a kept position
        stays the span's; the next allocation continues in it."""
        if length >= span.allocated_len:
            return
        assert length >= span.protected_len, "trim reaches into tree-owned positions"
        first_free = -(-length // self.page_size) * self.page_size
        if first_free < span.allocated_len:
            self.allocator.free(self._row_slots(span, span.allocated_len)[first_free:])
        span.allocated_len = length

    def preallocate(self, span: KVSpan, num_tokens: int, reserve: int) -> list[int] | None:
        """A row and `num_tokens` slots for KV another server will write (disaggregated
        decode), keeping `reserve` tokens for the running requests; None if they do not fit."""
        need = num_tokens + self.page_size + reserve
        if need > self.available_tokens() or self.rows.available_size() == 0:
            return None
        self._make_room(num_tokens + self.page_size)
        loc = self.allocator.alloc_extend([0], [num_tokens], [-1])
        if loc is None:
            return None
        [row] = self.rows.alloc(1) or [None]
        assert row is not None
        self.rows.host[row, :num_tokens] = loc.to(torch.int32)
        self.rows.log(row, 0, num_tokens)
        span.row, span.protected_len, span.allocated_len = row, 0, num_tokens
        return loc.tolist()

    def slots(self, span: KVSpan, n: int) -> list[int]:
        """The slots of the span's first n positions."""
        return self.rows.host[span.row, :n].tolist()

    # ---- caching and release -------------------------------------------------------
    def _row_slots(self, span: KVSpan, n: int) -> torch.Tensor:
        return self.rows.host[span.row, :n].to(torch.int64)

    def cache_unfinished(self, req: KVOwner) -> None:
        """A chunk boundary (or a prompt just launched): put the computed KV in the tree and
        point the request at the tree's slots, so later requests can share it."""
        span = req.kv
        tokens = req.kv_token_ids()
        n = len(tokens)
        kv = self._row_slots(span, n)
        if not self.tree.shares:
            span.prefix_indices = kv  # no sharing: the request keeps its own slots
            span.protected_len = 0
            return
        aligned = n - n % self.page_size
        present = self.tree.insert(tokens[:aligned], kv[:aligned], req.extra_key)
        self.allocator.free(kv[span.protected_len : present])  # the tree already had these
        match = self.tree.match_prefix(tokens[:aligned], req.extra_key)
        assert match.prefix_len == aligned, (match.prefix_len, aligned)
        self.rows.host[span.row, :aligned] = match.device_indices.to(torch.int32)
        self.rows.log(span.row, 0, aligned)
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(span.last_node)
        span.prefix_indices = self._row_slots(span, n)  # the tree's slots, then the tail's
        span.last_node = match.last_node
        span.protected_len = aligned

    def cache_finished(self, req: KVOwner) -> None:
        """A finished or retracted request: its KV goes into the tree (duplicates and the
        unaligned tail are freed), its lock and row are released."""
        span = req.kv
        if not self.tree.shares:
            self.release_uncached(span)
            return
        tokens = req.kv_token_ids()
        kv = self._row_slots(span, span.allocated_len)
        aligned = len(tokens) - len(tokens) % self.page_size
        present = self.tree.insert(tokens[:aligned], kv[:aligned], req.extra_key)
        self.allocator.free(kv[span.protected_len : present])
        self.allocator.free(kv[aligned:])
        self.tree.dec_lock_ref(span.last_node)
        self.rows.free(span.row)
        span.clear()

    def release_uncached(self, span: KVSpan) -> None:
        """Free the span's own slots and row without caching (their KV may never have been
        written, as for a failed KV transfer)."""
        self.allocator.free(self._row_slots(span, span.allocated_len)[span.protected_len :])
        self.tree.dec_lock_ref(span.last_node)
        self.rows.free(span.row)
        span.clear()

    # ---- quarantine: slots a peer may still write (disaggregated decode) ----------------
    # Not free and not evictable, so they count as used in `token_usage` and are never
    # handed out; the caller decides when the peer is done with them (an acknowledgement, or
    # a time bound) and releases them by key.
    def quarantine(self, key: Hashable, span: KVSpan) -> int:
        """Take the span's own slots out of use without freeing them, release its row and
        lock, and return how many slots are held."""
        if key in self.quarantined:
            raise ValueError(f"quarantine key {key!r} is already held")
        slots = self._row_slots(span, span.allocated_len)[span.protected_len :].clone()
        self.tree.dec_lock_ref(span.last_node)
        self.rows.free(span.row)
        span.clear()
        self.quarantined[key] = slots
        return len(slots)

    def release_quarantine(self, key: Hashable) -> int:
        """Free the slots held under `key` (0 when none are)."""
        slots = self.quarantined.pop(key, None)
        if slots is None:
            return 0
        self.allocator.free(slots)
        return len(slots)

    def quarantined_tokens(self) -> int:
        return sum(len(s) for s in self.quarantined.values())

    def _quarantined_slots(self) -> torch.Tensor:
        return torch.cat(list(self.quarantined.values())) if self.quarantined else _EMPTY

    # ---- overlap loop: rows freed while a forward may still read them -------------------
    def hold_row_frees(self, hold: bool) -> None:
        """The overlap loop holds freed rows until the forward that may read them is done;
        the normal loop frees them at once. Each scheduler sets its own mode when it takes
        the pool (a benchmark runs both loops on one worker, one after the other): no
        forward is in flight then, so rows the previous owner still held are free."""
        self.rows.hold_frees = hold
        self.rows.release(self.rows.take_held())

    def take_held_rows(self) -> list[int]:
        return self.rows.take_held()

    def release_rows(self, rows: list[int]) -> None:
        self.rows.release(rows)

    # ---- whole pool ----------------------------------------------------------------
    def flush(self) -> None:
        """Drop the tree and free everything; only when no request holds KV. Quarantined
        slots stay held (a peer may still write them): then only the tree's slots are freed."""
        if self.quarantined:
            self.allocator.free(self.tree.all_nodes_slots())
            self.tree.reset()
        else:
            self.tree.reset()
            self.allocator.clear()
        self.rows.clear()

    def check_integrity(self, spans: Iterable[KVSpan]) -> None:
        """Raise `MemoryLeakError` unless every page has exactly one owner (see module doc)."""
        check_memory_integrity(
            self.allocator, self.tree, spans, self.rows, self._quarantined_slots()
        )
