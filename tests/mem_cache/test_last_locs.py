"""`KVManager._last_locs`: one gather of the request table per batch, not a read per request.

On a GPU every element read of `req_to_token` is a device-to-host sync, and the lookup runs
every decode step. These tests drive a small batch through the manager (admit, decode) and
check the gather against the per-element loop it replaced, and that it indexes the table once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mem_cache.kv_manager import KVSpan
from tests.mem_cache.conftest import MemEnv


class CountingTable:
    """Stands in for `req_to_token`: delegates indexing to the tensor and counts it."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.device = table.device
        self.dtype = table.dtype
        self.reads = 0

    def __getitem__(self, index: object) -> torch.Tensor:
        self.reads += 1
        return self.table[index]


def _per_element(table: torch.Tensor, spans: list[KVSpan], lens: list[int]) -> list[int]:
    """The replaced loop: one element read per request."""
    return [int(table[s.row, n - 1]) if n > 0 else -1 for s, n in zip(spans, lens, strict=True)]


def _scripted_batch(make_env: Callable[..., MemEnv], page_size: int) -> MemEnv:
    env = make_env(page_size=page_size, size=256, rows=8)
    for i, n in enumerate((5, 8, 1, 13)):
        req = env.admit([100 * i + t for t in range(n)])
        for step in range(i + 1):  # page boundaries crossed at different steps
            env.decode(req, 7000 + step)
    env.check()
    return env


def test_gather_matches_the_per_element_loop(make_env: Callable[..., MemEnv]) -> None:
    env = _scripted_batch(make_env, page_size=4)
    spans = [r.kv for r in env.running]
    table = env.pool.req_to_token
    for lens in (
        [s.allocated_len for s in spans],  # the decode step's lookup
        [s.prefix_len() for s in spans],  # the extend step's lookup
        [0, 3, 0, 1],  # empty spans get -1
    ):
        expected = _per_element(table, spans, lens)
        assert env.kv._last_locs(spans, lens) == expected
    assert env.kv._last_locs([], []) == []


def test_one_indexing_call_per_batch(make_env: Callable[..., MemEnv]) -> None:
    env = _scripted_batch(make_env, page_size=4)
    spans = [r.kv for r in env.running]
    lens = [s.allocated_len for s in spans]
    expected = _per_element(env.pool.req_to_token, spans, lens)
    counting = CountingTable(env.pool.req_to_token)
    env.pool.req_to_token = counting  # type: ignore[assignment]
    try:
        assert env.kv._last_locs(spans, lens) == expected
        assert counting.reads == 1
    finally:
        env.pool.req_to_token = counting.table


def test_page_size_one_reads_nothing(make_env: Callable[..., MemEnv]) -> None:
    """The allocator ignores last slots with page_size 1, so the table is not touched."""
    env = _scripted_batch(make_env, page_size=1)
    spans = [r.kv for r in env.running]
    counting = CountingTable(env.pool.req_to_token)
    env.pool.req_to_token = counting  # type: ignore[assignment]
    try:
        assert env.kv._last_locs(spans, [s.allocated_len for s in spans]) == [-1] * len(spans)
        assert counting.reads == 0
    finally:
        env.pool.req_to_token = counting.table
    for req in list(env.running):  # decode and finish still work without them
        env.decode(req, 1)
        env.finish(req)
    env.check()
