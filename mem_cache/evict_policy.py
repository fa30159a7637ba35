"""Eviction policies for the radix tree: each maps an evictable leaf to a heap priority.

The smallest priority is evicted first. Ties are broken by the caller with the node id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from srt.utils.registry import Registry

if TYPE_CHECKING:
    from mem_cache.radix_cache import TreeNode


class EvictionStrategy(ABC):
    name: str

    @abstractmethod
    def priority(self, node: TreeNode) -> tuple[int, ...]: ...


class LRUStrategy(EvictionStrategy):
    """Least recently used first."""

    name = "lru"

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (node.last_access_time,)


class LFUStrategy(EvictionStrategy):
    """Fewest hits first; among equals the least recently used."""

    name = "lfu"

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (node.hit_count, node.last_access_time)


EVICTION_POLICIES: Registry[EvictionStrategy] = Registry("eviction policy")
EVICTION_POLICIES.register(LRUStrategy.name, LRUStrategy)
EVICTION_POLICIES.register(LFUStrategy.name, LFUStrategy)


def get_eviction_strategy(name: str) -> EvictionStrategy:
    return EVICTION_POLICIES.create(name)
