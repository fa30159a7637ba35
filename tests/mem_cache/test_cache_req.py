"""KVManager.cache_finished / cache_unfinished against real pools (see conftest.MemEnv)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

Env = Callable[..., Any]


def row_slots(env: Any, req: Any, n: int) -> list[int]:
    return env.row(req)[:n].tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_finish_inserts_and_next_req_hits(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size)
    a = env.admit(list(range(1, 11)))
    env.check()
    a_slots = row_slots(env, a, 10)
    env.finish(a)
    env.check()
    aligned = 10 // page_size * page_size
    assert env.cache.total_size() == aligned and env.cache.protected_size() == 0
    assert a.kv.row is None and a.kv.last_node is None and a.kv.protected_len == 0
    assert env.pool.available_size() == env.pool.size
    b = env.admit(list(range(1, 13)))
    assert b.kv.protected_len == aligned
    assert row_slots(env, b, aligned) == a_slots[:aligned]
    assert env.cache.protected_size() == aligned
    env.check()
    env.finish(b)
    env.check()
    assert env.cache.total_size() == 12


@pytest.mark.parametrize("page_size", [1, 4])
def test_concurrent_duplicates_are_freed(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size)
    prompt = list(range(20, 29))  # 9 tokens
    a = env.admit(prompt)
    b = env.admit(prompt)  # nothing cached yet: b owns its own copy
    assert b.kv.protected_len == 0
    env.check()
    free_before = env.allocator.available_size()
    env.finish(a)
    env.check()
    env.finish(b)  # b's aligned part duplicates the tree: freed, and its tail too
    env.check()
    aligned = 9 // page_size * page_size
    assert env.cache.total_size() == aligned
    assert env.allocator.available_size() == env.allocator.total_size() - aligned
    assert env.allocator.available_size() > free_before


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_then_finish_frees_unaligned_tail(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size)
    r = env.admit([5, 6, 7])
    for t in (8, 9, 10, 11, 12, 13):
        env.decode(r, t)
        env.check()
    assert r.kv_token_ids() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    env.finish(r)
    env.check()
    aligned = 9 // page_size * page_size
    assert env.cache.total_size() == aligned
    assert env.allocator.available_size() == env.allocator.total_size() - aligned


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_unfinished_then_finished(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size)
    prompt = list(range(100, 114))  # 14 tokens in chunks of 5, 5, 4
    r = env.admit(prompt, n_kv=5)
    own_tail = row_slots(env, r, 5)[5 // page_size * page_size :]
    env.kv.cache_unfinished(r)
    env.check()
    aligned = 5 // page_size * page_size
    assert r.kv.protected_len == aligned and r.kv.row is not None
    assert env.cache.total_size() == aligned and env.cache.protected_size() == aligned
    assert r.kv.last_node.lock_ref == 1
    tree_part = env.cache.match_prefix(prompt[:aligned]).device_indices.tolist()
    assert r.kv.prefix_indices.tolist() == tree_part + own_tail
    assert row_slots(env, r, 5) == tree_part + own_tail
    env.extend(r, 5)
    env.kv.cache_unfinished(r)
    env.check()
    assert r.kv.protected_len == 10 // page_size * page_size
    assert env.cache.evictable_size() == 0  # the whole cached prefix is locked by r
    env.extend(r, 4)
    env.check()
    env.finish(r)
    env.check()
    assert env.cache.total_size() == 14 // page_size * page_size
    assert env.cache.protected_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_unfinished_replaces_duplicates_with_tree_slots(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size)
    prompt = list(range(30, 42))
    a = env.admit(prompt)
    b = env.admit(prompt, n_kv=9)  # chunked, started before a was cached
    a_slots = row_slots(env, a, 12)
    env.finish(a)
    used_before = env.allocator.total_size() - env.allocator.available_size()
    env.kv.cache_unfinished(b)
    env.check()
    aligned = 9 // page_size * page_size
    assert row_slots(env, b, aligned) == a_slots[:aligned]
    used_after = env.allocator.total_size() - env.allocator.available_size()
    assert used_before - used_after == aligned  # b's duplicate copy went back
    env.extend(b, 3)
    env.finish(b)
    env.check()
    assert env.cache.total_size() == 12


def test_retract_then_resume_matches(make_env: Env) -> None:
    env = make_env(page_size=4)
    r = env.admit(list(range(8)))
    for t in range(8, 14):
        env.decode(r, t)
    kv_tokens = r.kv_token_ids()
    env.finish(r)  # retraction uses the same path
    env.check()
    again = env.admit(kv_tokens + [99])
    assert again.kv.protected_len == 12
    env.finish(again)
    env.check()


def test_extra_key_requests_do_not_share(make_env: Env) -> None:
    env = make_env()
    a = env.admit([1, 2, 3, 4], extra_key="lora-a")
    env.finish(a)
    b = env.admit([1, 2, 3, 4, 5])
    assert b.kv.protected_len == 0
    c = env.admit([1, 2, 3, 4, 5], extra_key="lora-a")
    assert c.kv.protected_len == 4
    env.check()
    env.finish(b)
    env.finish(c)
    env.check()
    assert env.cache.total_size() == 4 + 5 + 1


def test_eviction_under_pressure_keeps_integrity(make_env: Env) -> None:
    env = make_env(page_size=4, size=32)
    for i in range(6):
        r = env.admit([i] * 12)  # each needs 3 pages; the pool holds 8
        env.check()
        env.finish(r)
        env.check()
    assert env.cache.total_size() <= 32


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache(make_env: Env, page_size: int) -> None:
    env = make_env(page_size=page_size, chunk=True)
    c = env.cache
    r = env.admit(list(range(10)), n_kv=6)
    assert r.kv.protected_len == 0 and r.kv.last_node is None
    env.kv.cache_unfinished(r)
    assert r.kv.prefix_indices.tolist() == row_slots(env, r, 6) and r.kv.protected_len == 0
    env.check()
    env.extend(r, 4)
    env.decode(r, 10)
    env.finish(r)
    env.check()
    assert env.allocator.available_size() == env.allocator.total_size()
    assert env.pool.available_size() == env.pool.size
    assert (c.evictable_size(), c.protected_size(), c.total_size()) == (0, 0, 0)
    assert len(c.evict(10)) == 0 and c.inc_lock_ref(None) == 0 and c.dec_lock_ref(None) == 0
    assert c.insert([1, 2], torch.tensor([1, 2])) == 0
    assert c.match_prefix([0, 1, 2]).prefix_len == 0
