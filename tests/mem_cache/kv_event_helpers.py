"""A KV-event consumer's view, and the tree's page hashes to compare it with."""

from __future__ import annotations

from mem_cache.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    page_digests,
    public_hashes,
)
from mem_cache.radix_cache import RadixCache


class LiveSet:
    """A consumer's view: applies events, failing on a double store or a stray removal."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    assert h not in self.live, f"stored twice: {h}"
                    self.live.add(h)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.live, f"removed but not stored: {h}"
                    self.live.remove(h)
            else:
                self.live.clear()


def tree_hashes(tree: RadixCache) -> set[int]:
    """Every page hash the tree holds, recomputed from scratch along each root path."""
    out: set[int] = set()
    stack: list[tuple[object, list[int]]] = [(c, c.key) for c in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        out.update(public_hashes(page_digests(path, tree.page_size, None)))
        stack.extend((c, path + c.key) for c in node.children.values())
    return out
