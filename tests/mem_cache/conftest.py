"""Test doubles for mem_cache: a `FakeReq` and a tiny scheduler stand-in (`MemEnv`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.base_prefix_cache import BasePrefixCache
from mem_cache.chunk_cache import ChunkCache
from mem_cache.integrity import check_memory_integrity
from mem_cache.memory_pool import ReqToTokenPool
from mem_cache.radix_cache import RadixCache


@dataclass
class FakeReq:
    """The attributes of the scheduler's `Req` that the prefix caches read and write."""

    tokens: list[int]
    extra_key: str | None = None
    rid: str = "r"
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    kv_allocated_len: int = 0

    def kv_token_ids(self) -> list[int]:
        return self.tokens[: self.kv_allocated_len]


class MemEnv:
    """Pools + a prefix cache + the few scheduler steps that touch them."""

    def __init__(
        self,
        page_size: int = 1,
        size: int = 64,
        rows: int = 8,
        max_context_len: int = 64,
        chunk: bool = False,
        policy: str = "lru",
    ):
        self.page_size = page_size
        self.allocator = TokenToKVPoolAllocator(size, page_size)
        self.pool = ReqToTokenPool(rows, max_context_len)
        self.cache: BasePrefixCache
        if chunk:
            self.cache = ChunkCache(self.pool, self.allocator, page_size)
        else:
            self.cache = RadixCache(self.pool, self.allocator, page_size, eviction_policy=policy)
        self.running: list[FakeReq] = []
        self._n = 0

    def row(self, req: FakeReq) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.pool.req_to_token[req.req_pool_idx]

    def _last_loc(self, req: FakeReq, n: int) -> int:
        return int(self.row(req)[n - 1]) if n else 0

    def admit(self, tokens: list[int], n_kv: int | None = None, extra_key: str | None = None):
        """Match `tokens[:-1]`, lock, allocate positions prefix..n_kv (default all tokens)."""
        self._n += 1
        req = FakeReq(list(tokens), extra_key=extra_key, rid=f"r{self._n}")
        m = self.cache.match_prefix(req.tokens[:-1], extra_key)
        self.cache.inc_lock_ref(m.last_node)
        req.last_node, req.prefix_indices = m.last_node, m.device_indices
        req.cache_protected_len = m.prefix_len
        rows = self.pool.alloc(1)
        assert rows is not None
        req.req_pool_idx = rows[0]
        self.row(req)[: m.prefix_len] = m.device_indices.to(torch.int32)
        req.kv_allocated_len = m.prefix_len
        self.running.append(req)
        self.extend(req, (len(tokens) if n_kv is None else n_kv) - m.prefix_len)
        return req

    def extend(self, req: FakeReq, n_new: int) -> None:
        """Allocate and 'compute' KV for the next n_new token positions already in req.tokens."""
        n = req.kv_allocated_len
        args = ([n], [n + n_new], [self._last_loc(req, n)])
        slots = self.allocator.alloc_extend(*args)
        if slots is None:
            self.cache.evict(n_new + self.page_size)
            slots = self.allocator.alloc_extend(*args)
        assert slots is not None, "test pool too small"
        self.row(req)[n : n + n_new] = slots.to(torch.int32)
        req.kv_allocated_len = n + n_new

    def decode(self, req: FakeReq, token: int) -> None:
        n = req.kv_allocated_len
        req.tokens.append(token)
        slots = self.allocator.alloc_decode([n + 1], [self._last_loc(req, n)])
        assert slots is not None
        self.row(req)[n] = int(slots[0])
        req.kv_allocated_len = n + 1

    def finish(self, req: FakeReq) -> None:
        self.cache.cache_finished_req(req)
        self.running.remove(req)

    def check(self) -> None:
        check_memory_integrity(self.allocator, self.cache, self.running)


@pytest.fixture
def make_env() -> Callable[..., MemEnv]:
    return MemEnv
