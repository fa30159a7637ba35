"""Test doubles for mem_cache: a `FakeReq` and a tiny scheduler stand-in (`MemEnv`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.base_prefix_cache import BasePrefixCache
from mem_cache.chunk_cache import ChunkCache
from mem_cache.kv_manager import KVManager, KVSpan
from mem_cache.memory_pool import ReqToTokenPool
from mem_cache.radix_cache import RadixCache


@dataclass
class FakeReq:
    """Test double for the scheduler's `Req`: what `KVManager` reads of a request."""

    tokens: list[int]
    extra_key: str | None = None
    rid: str = "r"
    kv: KVSpan = field(default_factory=KVSpan)

    def kv_token_ids(self) -> list[int]:
        return self.tokens[: self.kv.allocated_len]


class MemEnv:
    """Pools + a prefix cache under a `KVManager` + the few scheduler steps that use it."""

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
            self.cache = ChunkCache(page_size)
        else:
            self.cache = RadixCache(page_size, eviction_policy=policy)
        self.kv = KVManager(self.pool, self.allocator, self.cache)
        self.running: list[FakeReq] = []
        self._n = 0

    def row(self, req: FakeReq) -> torch.Tensor:
        assert req.kv.row is not None
        return self.pool.req_to_token[req.kv.row]

    def admit(self, tokens: list[int], n_kv: int | None = None, extra_key: str | None = None):
        """Match `tokens[:-1]`, lock, allocate positions prefix..n_kv (default all tokens)."""
        self._n += 1
        req = FakeReq(list(tokens), extra_key=extra_key, rid=f"r{self._n}")
        req.kv.set_match(self.kv.match_prefix(req.tokens[:-1], extra_key))
        self.kv.lock(req.kv)
        self.kv.allocate_extend([req.kv], [len(tokens) if n_kv is None else n_kv])
        self.running.append(req)
        return req

    def extend(self, req: FakeReq, n_new: int) -> None:
        """Allocate and 'compute' KV for the next n_new token positions already in req.tokens
        (after a chunk boundary, `cache_unfinished`, made everything so far the prefix)."""
        assert req.kv.prefix_len() == req.kv.allocated_len
        self.kv.allocate_extend([req.kv], [req.kv.allocated_len + n_new])

    def decode(self, req: FakeReq, token: int) -> None:
        req.tokens.append(token)
        self.kv.allocate_decode([req.kv])

    def finish(self, req: FakeReq) -> None:
        self.kv.cache_finished(req)
        self.running.remove(req)

    def check(self) -> None:
        self.kv.check_integrity(r.kv for r in self.running)


@pytest.fixture
def make_env() -> Callable[..., MemEnv]:
    return MemEnv
