"""Radix tree from token-id sequences to KV slot indices: a pure tree.

It never sees a request or the allocator. `KVManager` (kv_manager.py) inserts a request's
slots, frees the duplicates `insert` reports, and frees what `evict` returns.
- `insert(key, slots)` stores the part of `key` not yet present and returns the length that
  was already present (the caller's slots for that part are duplicates).
- `match_prefix(key)` returns the slots of the longest cached prefix and its last node,
  splitting a node when the match ends inside it.
- Locks (`inc_lock_ref` / `dec_lock_ref`) walk to the root; a node with lock_ref 0 counts in
  `evictable_size`, one above 0 in `protected_size`. `evict(n)` removes unlocked leaves by the
  eviction policy until n tokens are gone and returns their slots.

Keys are page-aligned: with page_size > 1 children are keyed by their first page (a tuple)
and matches stop on page boundaries. Requests with different `extra_key` live in disjoint
subtrees: the root's children are keyed by `(extra_key, first)` when extra_key is not None.
Access times come from a per-tree counter, not the wall clock, so tests are deterministic.

KV events (kv_events.py), only while a recorder is attached: a new node records its pages as
stored, an evicted node its pages as removed, `reset` records all cleared. A node keeps its
pages' chained digests (32 bytes a page, the same in every extra_key namespace: the recorder
seeds the published hashes per namespace when asked); a split divides them between the two
halves and records nothing, so every stored page is removed exactly once, by eviction or by a
clear.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from mem_cache.evict_policy import get_eviction_strategy
from mem_cache.kv_events import DIGEST_BYTES, page_digests

logger = logging.getLogger(__name__)

_EMPTY = torch.empty((0,), dtype=torch.int64)
_node_ids = itertools.count()


@dataclass(slots=True, eq=False, repr=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=lambda: _EMPTY)
    parent: TreeNode | None = None
    children: dict[Any, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    hit_count: int = 0
    extra_key: str | None = None
    digests: bytes | None = None  # chained page digests, kept while KV events are recorded
    id: int = field(default_factory=lambda: next(_node_ids))

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(#{self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache):
    shares = True

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru") -> None:
        self.page_size = page_size
        self.eviction_strategy = get_eviction_strategy(eviction_policy)
        self._clock = 0
        self.reset()

    # -- sizes / lifecycle ----------------------------------------------------------------

    def reset(self) -> None:
        """Drop every node (their slots are not returned: the owner clears its allocator)."""
        self.root = TreeNode(lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0
        if self.events is not None:
            self.events.cleared()

    @property
    def root_node(self) -> TreeNode:
        return self.root

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- key helpers ------------------------------------------------------------------------

    def _child_key(self, parent: TreeNode, key: list[int], extra_key: str | None) -> Any:
        first: Any = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        if parent is self.root and extra_key is not None:
            return (extra_key, first)
        return first

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Common prefix length of a and b, rounded down to a page boundary."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # -- match / insert ---------------------------------------------------------------------

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        if not key:
            return MatchResult(_EMPTY.clone(), self.root)
        key = key[: self._aligned(len(key))]
        now = self._tick()
        node = self.root
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(node, key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            child.hit_count += 1
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        aligned = self._aligned(len(key))
        key, value = key[:aligned], value[:aligned].to(torch.int64)
        now = self._tick()
        node = self.root
        present = 0
        while key:
            child = node.children.get(self._child_key(node, key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            present += n
            key, value = key[n:], value[n:]
            node = self._split(child, n) if n < len(child.key) else child
        if key:
            new = TreeNode(
                key=list(key),
                value=value.clone(),
                parent=node,
                last_access_time=now,
                extra_key=extra_key,
            )
            node.children[self._child_key(node, key, extra_key)] = new
            self._evictable_size += len(key)
            if self.events is not None:
                parent = self._digests(node)[-DIGEST_BYTES:] if node is not self.root else None
                self.events.stored(self._digests(new), parent, new.key, self.page_size, extra_key)
        return present

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n].clone(),
            parent=parent,
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
            hit_count=child.hit_count,
            extra_key=child.extra_key,
        )
        parent.children[self._child_key(parent, child.key, child.extra_key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        if child.digests is not None:
            cut = n // self.page_size * DIGEST_BYTES
            upper.digests, child.digests = child.digests[:cut], child.digests[cut:]
        child.parent = upper
        upper.children[self._child_key(upper, child.key, child.extra_key)] = child
        return upper

    # -- locks --------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock node..root; return the change in evictable_size (<= 0)."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock node..root; return the change in evictable_size (>= 0)."""
        delta = 0
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked node {node.id}")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # -- eviction -----------------------------------------------------------------------------

    def _iter_nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove unlocked leaves (policy order) until `num_tokens` are gone; their slots."""
        if num_tokens <= 0:
            return _EMPTY.clone()
        prio = self.eviction_strategy.priority
        heap = [
            (prio(n), n.id, n)
            for n in self._iter_nodes()
            if n.is_leaf() and n.lock_ref == 0 and n is not self.root
        ]
        heapq.heapify(heap)
        freed = 0
        released: list[torch.Tensor] = []
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(parent, node.key, node.extra_key)]
            released.append(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            if self.events is not None:
                self.events.removed(self._digests(node), node.extra_key)
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (prio(parent), parent.id, parent))
        return torch.cat(released) if released else _EMPTY.clone()

    # -- KV events ----------------------------------------------------------------------------

    def _digests(self, node: TreeNode) -> bytes:
        """The node's page digests, chained from its parent's last page (computed on first use:
        nodes inserted before a recorder was attached have none yet)."""
        missing: list[TreeNode] = []
        cur = node
        while cur is not self.root and cur.digests is None:
            missing.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        for n in reversed(missing):
            parent = n.parent
            assert parent is not None
            # A chain starts afresh at the root whatever the namespace, as SGLang's does; the
            # recorder namespaces the published hashes when the format asks for it.
            if parent is self.root:
                prior = None
            else:
                assert parent.digests is not None
                prior = parent.digests[-DIGEST_BYTES:]
            n.digests = page_digests(n.key, self.page_size, prior)
        assert node.digests is not None
        return node.digests

    # -- introspection ------------------------------------------------------------------------

    def all_nodes_slots(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes() if n is not self.root]
        return torch.cat(values) if values else _EMPTY.clone()

    def recompute_sizes(self) -> tuple[int, int]:
        evictable = protected = 0
        for node in self._iter_nodes():
            if node is self.root:
                continue
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        return evictable, protected

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root:
                ns = f" ns={node.extra_key!r}" if node.extra_key is not None else ""
                lines.append(
                    f"{'  ' * depth}#{node.id} len={len(node.key)} key={node.key[:8]}"
                    f"{'...' if len(node.key) > 8 else ''} lock={node.lock_ref}{ns}"
                )
            stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(
            f"total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size}"
        )
        text = "\n".join(lines)
        print(text)
        return text
