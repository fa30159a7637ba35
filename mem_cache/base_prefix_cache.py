"""Abstract prefix cache: a tree from token ids to KV slot indices, as `KVManager` uses it.

Two implementations: `RadixCache` (prefix sharing, the default) and `ChunkCache` (no
sharing, `--disable-radix-cache`). A prefix cache never sees a request or the allocator: it
returns what it evicts, and `KVManager` (kv_manager.py) owns the slots around it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mem_cache.kv_events import KVEventRecorder


@dataclass(slots=True)
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: Any  # the deepest matched tree node (lock it to keep the prefix)

    @property
    def prefix_len(self) -> int:
        return len(self.device_indices)


class BasePrefixCache(ABC):
    page_size: int
    shares: bool  # False: nothing is ever inserted, a request keeps its slots to the end
    events: KVEventRecorder | None = None  # set: record stored / removed pages (kv_events.py)

    def record_events(self, recorder: KVEventRecorder) -> None:
        """From now on, append what the cache stores, evicts and clears to `recorder`."""
        self.events = recorder

    @abstractmethod
    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert; return the length of the prefix that was already present."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Evict at least `num_tokens` if possible; return the evicted slots."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    def pretty_print(self) -> str:
        return f"<{type(self).__name__}>"

    def all_nodes_slots(self) -> torch.Tensor:
        """Every KV slot the cache owns (for the integrity check)."""
        return torch.empty((0,), dtype=torch.int64)

    def recompute_sizes(self) -> tuple[int, int]:
        """(evictable, protected) recomputed from scratch; the integrity check compares."""
        return self.evictable_size(), self.protected_size()
