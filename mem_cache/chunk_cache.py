"""The no-sharing prefix cache used with `--disable-radix-cache`.

Ownership: every KV slot of a request belongs to that request from allocation until
`cache_finished_req`, which frees all of them and the request's `req_to_token` row. A
chunked prefill keeps its slots across chunks (`cache_unfinished_req` only records them as
the request's prefix). Nothing is ever shared, so sizes are 0 and there is nothing to evict.
`RadixCache(disable=True)` delegates to the two module functions below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

if TYPE_CHECKING:
    from mem_cache.allocator import TokenToKVPoolAllocator
    from mem_cache.memory_pool import ReqToTokenPool

_EMPTY = torch.empty((0,), dtype=torch.int64)


def req_allocated_len(req: Any, n_tokens: int) -> int:
    """Slots the request allocated: `kv_allocated_len` when set, else its KV token count."""
    alloc_len = getattr(req, "kv_allocated_len", None)
    return n_tokens if alloc_len is None else max(alloc_len, n_tokens)


def release_req_unshared(
    req: Any, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator
) -> None:
    """Free every slot the request owns (positions >= cache_protected_len) and its row."""
    row = req.req_pool_idx
    n = req_allocated_len(req, len(req.kv_token_ids()))
    kv = req_to_token_pool.req_to_token[row, :n].to(torch.int64)
    allocator.free(kv[req.cache_protected_len :])
    req_to_token_pool.free(row)
    req.req_pool_idx = None
    req.last_node = None
    req.prefix_indices = _EMPTY.clone()
    req.cache_protected_len = 0


def keep_req_unshared(req: Any, req_to_token_pool: ReqToTokenPool) -> None:
    """Chunk boundary without sharing: the request keeps all its slots as its prefix."""
    n = len(req.kv_token_ids())
    req.prefix_indices = req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)
    req.cache_protected_len = 0


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = True

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(_EMPTY.clone(), None)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        return 0

    def cache_finished_req(self, req: Any) -> None:
        release_req_unshared(req, self.req_to_token_pool, self.token_to_kv_pool_allocator)

    def cache_unfinished_req(self, req: Any) -> None:
        keep_req_unshared(req, self.req_to_token_pool)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
