"""Proof that no KV page is leaked or owned twice.

Every page 1..num_pages must be owned by exactly one of: the allocator's free list, a radix
tree node, a running request's own positions (`req_to_token[row, protected_len:
allocated_len]` of its `KVSpan`), or the quarantine (slots a disaggregation peer may still
write), and `free + evictable + protected + own + quarantined == total` in tokens.
`KVManager.check_integrity` calls it when the scheduler goes idle; tests call it after steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mem_cache.allocator import TokenToKVPoolAllocator
    from mem_cache.base_prefix_cache import BasePrefixCache
    from mem_cache.kv_manager import KVSpan
    from mem_cache.memory_pool import ReqToTokenPool

_MAX_LISTED = 8


class MemoryLeakError(AssertionError):
    """A KV page is leaked, double-owned, or the size accounting does not add up."""


def _pages_of(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    return slots.to(device="cpu", dtype=torch.int64) // page_size


def _fmt(pages: torch.Tensor) -> str:
    listed = pages[:_MAX_LISTED].tolist()
    more = f" (+{len(pages) - _MAX_LISTED} more)" if len(pages) > _MAX_LISTED else ""
    return f"{listed}{more}"


def check_memory_integrity(
    allocator: TokenToKVPoolAllocator,
    tree_cache: BasePrefixCache,
    spans: Iterable[KVSpan] = (),
    req_to_token_pool: ReqToTokenPool | None = None,
    quarantined: torch.Tensor | None = None,
) -> None:
    ps = allocator.page_size
    num_pages = allocator.num_pages
    pool = req_to_token_pool
    errors: list[str] = []

    owners: list[tuple[str, torch.Tensor]] = [("free list", allocator.free_pages())]
    free_pages = owners[0][1]
    if len(torch.unique(free_pages)) != len(free_pages):
        errors.append("free list holds a page twice (double free)")

    tree_slots = tree_cache.all_nodes_slots().to(device="cpu", dtype=torch.int64)
    tree_pages = torch.unique(_pages_of(tree_slots, ps))
    if len(torch.unique(tree_slots)) != len(tree_slots):
        errors.append("a KV slot appears in two tree nodes")
    if len(tree_pages) * ps != len(tree_slots):
        errors.append(
            f"tree holds {len(tree_slots)} slots on {len(tree_pages)} pages (not page-aligned)"
        )
    owners.append(("tree", tree_pages))

    req_tokens = 0
    for span in spans:
        if span.row is None:
            continue
        node = span.last_node
        if node is not None and getattr(node, "lock_ref", 1) <= 0:
            errors.append(f"row {span.row} holds last_node #{node.id} that is not locked")
        if pool is None:
            raise ValueError("spans given but no req_to_token_pool")
        own = pool.host[span.row, span.protected_len : span.allocated_len]
        own_pages = torch.unique(_pages_of(own, ps))
        req_tokens += len(own_pages) * ps
        owners.append((f"row {span.row}", own_pages))

    quarantined_tokens = 0
    if quarantined is not None and len(quarantined):
        if len(torch.unique(quarantined)) != len(quarantined):
            errors.append("the quarantine holds a slot twice")
        q_pages = torch.unique(_pages_of(quarantined, ps))
        quarantined_tokens = len(q_pages) * ps
        owners.append(("quarantine", q_pages))

    all_pages = torch.cat([p for _, p in owners])
    bad = all_pages[(all_pages < 1) | (all_pages > num_pages)]
    if len(bad):
        errors.append(f"pages out of range 1..{num_pages} (page 0 is the dummy): {_fmt(bad)}")
    counts = torch.bincount(all_pages.clamp(0, num_pages + 1), minlength=num_pages + 2)
    counts = counts[1 : num_pages + 1]
    leaked = torch.nonzero(counts == 0).flatten() + 1
    if len(leaked):
        errors.append(f"{len(leaked)} page(s) leaked (no owner): {_fmt(leaked)}")
    doubled = torch.nonzero(counts > 1).flatten() + 1
    for page in doubled[:_MAX_LISTED].tolist():
        who = [name for name, pages in owners if bool((pages == page).any())]
        errors.append(f"page {page} owned by {int(counts[page - 1])} owners: {who}")

    evictable, protected = tree_cache.evictable_size(), tree_cache.protected_size()
    if (evictable, protected) != tree_cache.recompute_sizes():
        errors.append(
            f"tree counters evictable={evictable} protected={protected} but nodes say "
            f"{tree_cache.recompute_sizes()}"
        )
    if evictable + protected != len(tree_slots):
        errors.append(
            f"evictable+protected={evictable + protected} != tree slots {len(tree_slots)}"
        )
    free = allocator.available_size()
    total = allocator.total_size()
    owned = free + evictable + protected + req_tokens + quarantined_tokens
    if owned != total:
        errors.append(
            f"accounting: free={free} + evictable={evictable} + protected={protected} "
            f"+ running={req_tokens} + quarantined={quarantined_tokens} = {owned} != "
            f"total={total}"
        )
    if errors:
        raise MemoryLeakError("memory integrity check failed:\n  " + "\n  ".join(errors))


def token_usage(allocator: TokenToKVPoolAllocator, tree_cache: BasePrefixCache) -> float:
    """Fraction of KV slots neither free nor evictable (0.0 .. 1.0)."""
    total = allocator.total_size()
    if total == 0:
        return 0.0
    used = total - allocator.available_size() - tree_cache.evictable_size()
    return used / total
