from __future__ import annotations

import pytest
import torch

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache


def vals(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_empty_match() -> None:
    c = RadixCache()
    m = c.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and m.last_node is c.root and m.device_indices.dtype == torch.int64
    assert c.match_prefix([]).last_node is c.root


def test_insert_returns_already_present_len() -> None:
    c = RadixCache()
    assert c.insert([1, 2, 3], vals(10, 3)) == 0
    assert c.insert([1, 2, 3], vals(20, 3)) == 3
    assert c.insert([1, 2, 3, 4, 5], vals(30, 5)) == 3
    assert c.insert([1, 2, 9], vals(40, 3)) == 2  # splits [1,2,3] inside
    assert c.insert([7], vals(50, 1)) == 0
    assert c.total_size() == 3 + 2 + 1 + 1 == c.evictable_size()
    # the tree keeps the first inserted slots for shared positions
    assert c.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [10, 11, 12, 33, 34]
    assert c.match_prefix([1, 2, 9]).device_indices.tolist() == [10, 11, 42]


def test_match_splits_inside_node() -> None:
    c = RadixCache()
    c.insert([1, 2, 3, 4, 5], vals(100, 5))
    m = c.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == [100, 101, 102]
    node = m.last_node
    assert node.key == [1, 2, 3] and node.parent is c.root
    (child,) = node.children.values()
    assert child.key == [4, 5] and child.value.tolist() == [103, 104] and child.parent is node
    assert list(node.children) == [4] and list(c.root.children) == [1]
    assert c.total_size() == 5
    # matching the whole thing walks both nodes
    full = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.prefix_len == 5 and full.last_node is child


def test_lock_moves_sizes_and_protects() -> None:
    c = RadixCache()
    c.insert([1, 2, 3, 4], vals(0, 4))
    c.insert([1, 2, 7, 8, 9], vals(10, 5))  # tree: [1,2] -> {[3,4], [7,8,9]}
    m = c.match_prefix([1, 2, 3, 4])
    assert c.inc_lock_ref(m.last_node) == -4
    assert c.evictable_size() == 3 and c.protected_size() == 4
    assert c.inc_lock_ref(m.last_node) == 0  # second lock moves nothing
    assert len(c.evict(100)) == 3  # only the unlocked branch goes
    assert c.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert c.match_prefix([1, 2, 7]).prefix_len == 2
    assert c.dec_lock_ref(m.last_node) == 0
    assert c.dec_lock_ref(m.last_node) == 4
    assert c.evictable_size() == 4 and c.protected_size() == 0
    with pytest.raises(RuntimeError):
        c.dec_lock_ref(m.last_node)
    assert len(c.evict(1)) == 2  # the leaf [3,4]; then its parent [1,2] is a leaf
    assert len(c.evict(1)) == 2 and c.total_size() == 0


def test_lock_on_split_node_keeps_lock_state() -> None:
    c = RadixCache()
    c.insert([1, 2, 3, 4], vals(0, 4))
    node = c.match_prefix([1, 2, 3, 4]).last_node
    c.inc_lock_ref(node)
    c.match_prefix([1, 2, 5])  # splits the locked node; both halves stay locked
    assert c.protected_size() == 4 and c.recompute_sizes() == (0, 4)
    c.dec_lock_ref(node)
    assert c.evictable_size() == 4 and c.recompute_sizes() == (4, 0)


def _three_leaves(policy: str) -> RadixCache:
    c = RadixCache(eviction_policy=policy)
    c.insert([1, 1, 1], vals(0, 3))
    c.insert([2, 2, 2], vals(3, 3))
    c.insert([3, 3, 3], vals(6, 3))
    return c


def test_evict_lru_order() -> None:
    c = _three_leaves("lru")
    c.match_prefix([1, 1, 1])  # now [2,2,2] is the least recently used
    assert len(c.evict(1)) == 3
    assert c.match_prefix([2, 2, 2]).prefix_len == 0
    assert c.match_prefix([1, 1, 1]).prefix_len == 3
    assert len(c.evict(1)) == 3  # next oldest: [3,3,3]
    assert c.match_prefix([3, 3, 3]).prefix_len == 0


def test_evict_lfu_vs_lru() -> None:
    def scenario(policy: str) -> RadixCache:
        c = _three_leaves(policy)
        for _ in range(3):
            c.match_prefix([1, 1, 1])
        c.match_prefix([2, 2, 2])
        c.match_prefix([3, 3, 3])
        c.match_prefix([2, 2, 2])  # [2,2,2]: 2 hits; [3,3,3]: 1 hit; [1,1,1]: 3 hits, oldest
        return c

    lru = scenario("lru")
    lru.evict(1)
    assert lru.match_prefix([1, 1, 1]).prefix_len == 0
    lfu = scenario("lfu")
    lfu.evict(1)
    assert lfu.match_prefix([3, 3, 3]).prefix_len == 0
    assert lfu.match_prefix([1, 1, 1]).prefix_len == 3


def test_evict_parent_becomes_leaf_and_frees_slots() -> None:
    alloc = TokenToKVPoolAllocator(16)
    c = RadixCache()
    a = alloc.alloc(3)
    b = alloc.alloc(3)
    assert a is not None and b is not None
    c.insert([1, 2, 3], a)
    assert c.insert([1, 2, 4], b) == 2
    alloc.free(b[:2])  # caller frees its duplicates
    assert alloc.available_size() == 16 - 4
    evicted = c.evict(3)  # the tree returns the slots; their owner frees them
    alloc.free(evicted)
    assert len(evicted) >= 3  # two leaves of 1, then the parent [1,2]
    assert c.total_size() == 0 and c.evictable_size() == 0
    assert alloc.available_size() == 16
    assert len(c.evict(5)) == 0


def test_extra_key_isolation() -> None:
    c = RadixCache()
    c.insert([1, 2, 3], vals(0, 3), extra_key="a")
    assert c.match_prefix([1, 2, 3]).prefix_len == 0
    assert c.match_prefix([1, 2, 3], extra_key="b").prefix_len == 0
    assert c.match_prefix([1, 2, 3], extra_key="a").prefix_len == 3
    assert c.insert([1, 2, 3], vals(10, 3)) == 0  # default namespace is separate
    assert c.insert([1, 2, 5], vals(20, 3), extra_key="a") == 2
    assert c.match_prefix([1, 2, 5], extra_key="a").device_indices.tolist() == [0, 1, 22]
    assert c.match_prefix([1, 2, 3]).device_indices.tolist() == [10, 11, 12]
    assert c.total_size() == 3 + 1 + 3
    assert len(c.evict(100)) == 7 and c.total_size() == 0


def test_page_size_4_aligned_keys() -> None:
    c = RadixCache(page_size=4)
    key = list(range(10))
    assert c.insert(key, vals(100, 10)) == 0
    assert c.total_size() == 8  # truncated to two pages
    assert c.match_prefix(key).prefix_len == 8
    assert c.match_prefix(key[:7]).prefix_len == 4
    m = c.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])  # diverges inside the second page
    assert m.device_indices.tolist() == [100, 101, 102, 103]
    assert m.last_node.key == [0, 1, 2, 3]
    assert list(c.root.children) == [(0, 1, 2, 3)]
    assert list(m.last_node.children) == [(4, 5, 6, 7)]
    assert c.insert([0, 1, 2, 3, 4, 5, 9, 9], vals(200, 8)) == 4
    tail = c.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).device_indices.tolist()[4:]
    assert tail == [204, 205, 206, 207]
    assert c.match_prefix([0, 1, 2]).prefix_len == 0


def test_reset_pretty_print_and_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    c = RadixCache()
    c.insert([1, 2, 3], vals(0, 3))
    c.insert([1, 5], vals(3, 2), extra_key="ns")
    text = c.pretty_print()
    assert "len=3" in text and "ns='ns'" in text and "total=5" in text
    assert "total=5" in capsys.readouterr().out
    assert c.all_nodes_slots().numel() == 5
    c.reset()
    assert c.total_size() == 0 and c.match_prefix([1, 2, 3]).prefix_len == 0
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixCache(eviction_policy="nope")
