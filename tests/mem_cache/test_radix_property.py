"""Property tests: the radix tree against a naive model, integrity checked after every step.

The model maps every cached page-aligned prefix `(extra_key, tokens[:(j+1)*page_size])` to
the slots of page j. Eviction is mirrored without looking inside the tree: the slots the
allocator gets back are exactly those of the model entries that disappear.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.integrity import check_memory_integrity
from mem_cache.radix_cache import RadixCache

# Keys share prefixes with a few base prompts and diverge at random points (often mid-page,
# mid-node), so matches, splits and evictions of shared ancestors are common.
BASES = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 2, 2, 1, 0, 0, 1, 1, 2],
    [1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0],
]
keys = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=4),
)
extra_keys = st.sampled_from([None, None, "x"])
# Inserts, matches and locks are drawn more often than unlocks and explicit evictions
# (inserts evict on their own when the pool is full). Each op is (name, key, extra_key, n).
TREE_OPS = ["insert", "insert", "insert", "match", "match", "lock", "lock", "unlock", "evict"]
tree_ops = st.lists(
    st.tuples(st.sampled_from(TREE_OPS), keys, extra_keys, st.integers(1, 12)),
    min_size=8,
    max_size=50,
)

Prefix = tuple[str | None, tuple[int, ...]]


class TreeModel:
    def __init__(self, page_size: int, size: int, policy: str):
        self.ps = page_size
        self.alloc = TokenToKVPoolAllocator(size, page_size)
        self.cache = RadixCache(page_size, eviction_policy=policy)
        self.slots_of: dict[Prefix, list[int]] = {}
        self.locks: list[tuple[str | None, list[int], Any]] = []

    def free_slots(self) -> set[int]:
        pages = self.alloc.free_pages().tolist()
        return {p * self.ps + o for p in pages for o in range(self.ps)}

    def expected_match(self, key: list[int], ek: str | None) -> list[int]:
        out: list[int] = []
        for end in range(self.ps, len(key) + 1, self.ps):
            slots = self.slots_of.get((ek, tuple(key[:end])))
            if slots is None:
                break
            out.extend(slots)
        return out

    def match(self, key: list[int], ek: str | None) -> Any:
        expected = self.expected_match(key, ek)
        m = self.cache.match_prefix(key, ek)
        assert m.device_indices.tolist() == expected
        return m

    def evict(self, n: int) -> None:
        before = self.free_slots()
        evicted = self.cache.evict(n)  # the tree returns the slots; their owner frees them
        self.alloc.free(evicted)
        freed = len(evicted)
        gone = self.free_slots() - before
        removed = [k for k, slots in self.slots_of.items() if slots[0] in gone]
        assert all(set(self.slots_of[k]) <= gone for k in removed)
        assert len(removed) * self.ps == len(gone) == freed
        for k in removed:
            del self.slots_of[k]
        if freed < n:
            assert self.cache.evictable_size() == 0
        for ek, key, _ in self.locks:
            assert len(self.expected_match(key, ek)) == len(key), "a locked prefix was evicted"

    def insert(self, key: list[int], ek: str | None) -> None:
        aligned = len(key) - len(key) % self.ps
        slots = self.alloc.alloc_extend([0], [aligned], [0])
        if slots is None:
            self.evict(aligned)
            slots = self.alloc.alloc_extend([0], [aligned], [0])
            if slots is None:
                return
        expected_present = len(self.expected_match(key, ek))
        assert self.cache.insert(key, slots, ek) == expected_present
        self.alloc.free(slots[:expected_present])
        for start in range(expected_present, aligned, self.ps):
            end = start + self.ps
            self.slots_of[(ek, tuple(key[:end]))] = slots[start:end].tolist()

    def step(self, op: str, key: list[int], ek: str | None, n: int) -> None:
        if op == "insert":
            self.insert(key, ek)
        elif op == "match":
            self.match(key, ek)
        elif op == "lock":
            m = self.match(key, ek)
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((ek, key[: m.prefix_len], m.last_node))
        elif op == "unlock" and self.locks:
            _, _, node = self.locks.pop(n % len(self.locks))
            self.cache.dec_lock_ref(node)
        elif op == "evict":
            self.evict(n)

    def check(self) -> None:
        check_memory_integrity(self.alloc, self.cache)
        assert self.cache.total_size() == len(self.slots_of) * self.ps
        locked = {
            (ek, tuple(key[:end]))
            for ek, key, _ in self.locks
            for end in range(self.ps, len(key) + 1, self.ps)
        }
        assert self.cache.protected_size() == len(locked) * self.ps


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@settings(max_examples=120, deadline=None)
@given(ops=tree_ops)
def test_tree_matches_naive_model(page_size: int, policy: str, ops: list[tuple]) -> None:
    model = TreeModel(page_size, size=40, policy=policy)
    for op in ops:
        model.step(*op)
        model.check()
    while model.locks:
        model.step("unlock", [], None, 0)
    model.evict(10**6)
    model.check()
    assert model.alloc.available_size() == model.alloc.total_size()


req_ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), keys.filter(bool), st.integers(1, 16)),
        st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 2)),
        st.tuples(st.just("chunk"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("finish"), st.integers(0, 7), st.none()),
        st.tuples(st.just("evict"), st.integers(1, 16), st.none()),
    ),
    min_size=8,
    max_size=40,
)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=req_ops)
def test_request_lifecycle_integrity(
    make_env: Callable[..., Any], page_size: int, ops: list[tuple]
) -> None:
    """Random admits / decodes / chunk boundaries / finishes never leak or double-own."""
    env = make_env(page_size=page_size, size=48, rows=4)
    ps = page_size
    chunked: dict[str, int] = {}  # rid -> prompt positions still without KV

    def room(n: int) -> bool:
        return env.allocator.available_size() + env.cache.evictable_size() >= n + 2 * ps

    for op, a, b in ops:
        if op == "admit" and env.pool.available_size() and room(len(a)):
            n_kv = min(b, len(a))
            req = env.admit(a, n_kv=max(n_kv, len(env.cache.match_prefix(a[:-1]).device_indices)))
            chunked[req.rid] = len(a) - req.kv.allocated_len
            if chunked[req.rid]:
                env.kv.cache_unfinished(req)
        elif op in ("decode", "chunk", "finish") and env.running:
            req = env.running[a % len(env.running)]
            left = chunked[req.rid]
            if op == "finish":
                env.finish(req)
            elif left and room(left):
                n = min(b, left) if op == "chunk" else left
                env.extend(req, n)
                chunked[req.rid] = left - n
                env.kv.cache_unfinished(req)
            elif not left and op == "decode" and room(1):
                env.decode(req, b)
        elif op == "evict":
            env.kv.evict(a)
        env.check()
    for req in list(env.running):
        env.finish(req)
    env.check()
    assert env.cache.protected_size() == 0
    env.kv.evict(10**6)
    assert env.allocator.available_size() == env.allocator.total_size()
