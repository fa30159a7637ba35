"""The prefix cache that shares nothing (`--disable-radix-cache`).

It stores no node and matches nothing, so `KVManager` keeps every slot with its request from
allocation until the request finishes (or is retracted), then frees them all; a chunked
prefill keeps its slots across chunks. Sizes are always 0 and there is nothing to evict.
"""

from __future__ import annotations

from typing import Any

import torch

from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult

_EMPTY = torch.empty((0,), dtype=torch.int64)


class ChunkCache(BasePrefixCache):
    shares = False

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(_EMPTY.clone(), None)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        return 0

    def evict(self, num_tokens: int) -> torch.Tensor:
        return _EMPTY.clone()

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
        if self.events is not None:
            self.events.cleared()
