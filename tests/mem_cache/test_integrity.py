from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.integrity import MemoryLeakError, check_memory_integrity, token_usage
from mem_cache.radix_cache import RadixCache

Env = Callable[..., Any]


def test_clean_state_passes() -> None:
    alloc = TokenToKVPoolAllocator(16, page_size=4)
    check_memory_integrity(alloc, RadixCache(page_size=4))


def test_detects_leak() -> None:
    alloc = TokenToKVPoolAllocator(16)
    cache = RadixCache()
    x = alloc.alloc(3)
    assert x is not None
    with pytest.raises(MemoryLeakError, match=r"3 page\(s\) leaked") as info:
        check_memory_integrity(alloc, cache)
    assert str(sorted(x.tolist())) in str(info.value)  # names the leaked pages
    assert isinstance(info.value, AssertionError)
    alloc.free(x)
    check_memory_integrity(alloc, cache)


def test_detects_tree_and_free_list_double_ownership() -> None:
    alloc = TokenToKVPoolAllocator(16)
    cache = RadixCache()
    x = alloc.alloc(2)
    assert x is not None
    cache.insert([1, 2], x)
    check_memory_integrity(alloc, cache)
    alloc.free(x[:1])  # bug: the tree still owns this slot
    with pytest.raises(MemoryLeakError, match=rf"page {int(x[0])} owned by 2 owners"):
        check_memory_integrity(alloc, cache)


def test_detects_double_free() -> None:
    alloc = TokenToKVPoolAllocator(8, page_size=4)
    x = alloc.alloc_extend([0], [4], [0])
    assert x is not None
    alloc.free(x)
    alloc.free(x)
    with pytest.raises(MemoryLeakError, match="double free"):
        check_memory_integrity(alloc, RadixCache(page_size=4))


def test_running_req_tail_is_owned(make_env: Env) -> None:
    env = make_env(page_size=4)
    r = env.admit(list(range(10)))
    env.check()
    with pytest.raises(MemoryLeakError, match="leaked"):
        check_memory_integrity(env.allocator, env.cache)  # forgot the running request
    # a request claiming tree pages as its own is double ownership
    env.finish(r)
    r2 = env.admit(list(range(10)))
    r2.kv.protected_len = 0
    with pytest.raises(MemoryLeakError, match="owned by 2 owners"):
        env.check()


def test_detects_size_counter_drift_and_unlocked_last_node(make_env: Env) -> None:
    env = make_env()
    r = env.admit([1, 2, 3])
    env.finish(r)
    r = env.admit([1, 2, 3, 4])
    env.check()
    env.cache._evictable_size += 1  # simulate a lock accounting bug
    with pytest.raises(MemoryLeakError, match="tree counters"):
        env.check()
    env.cache._evictable_size -= 1
    r.kv.last_node.lock_ref = 0
    with pytest.raises(MemoryLeakError, match="not locked"):
        env.check()


def test_token_usage() -> None:
    alloc = TokenToKVPoolAllocator(10)
    cache = RadixCache()
    assert token_usage(alloc, cache) == 0.0
    x = alloc.alloc(4)
    assert x is not None
    cache.insert([1, 2, 3, 4], x)
    assert token_usage(alloc, cache) == 0.0  # evictable counts as available
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3, 4]).last_node)
    assert token_usage(alloc, cache) == pytest.approx(0.4)
    assert torch.equal(torch.sort(cache.all_nodes_slots()).values, torch.sort(x).values)
