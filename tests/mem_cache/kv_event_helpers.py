"""A KV-event consumer's view, the tree's page hashes to compare it with, and SGLang's own
event structs (loaded from the installed `sglang` package) to decode our batches with."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mem_cache.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    namespace_seed,
    page_digests,
    public_hashes,
)
from mem_cache.kv_events import namespaced as namespaced_hashes
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


def per_page(events: list[KVEvent]) -> list[tuple[int, int | None, list[int]]]:
    """Every stored page as (hash, parent hash, token ids): a BlockStored of several pages
    chains them in order, its first to its parent_block_hash."""
    out = []
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        size = e.block_size
        assert len(e.token_ids) == size * len(e.block_hashes)
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out.append((h, parent, e.token_ids[i * size : (i + 1) * size]))
            parent = h
    return out


def tree_hashes(tree: RadixCache, namespaced: bool = False) -> set[int]:
    """Every page hash the tree holds, recomputed from scratch along each root path (seeded
    by each path's extra_key when `namespaced`, the "dynamo" format)."""
    out: set[int] = set()
    stack: list[tuple[object, list[int]]] = [(c, c.key) for c in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        seed = namespace_seed(node.extra_key) if namespaced else None
        out.update(namespaced_hashes(public_hashes(page_digests(path, tree.page_size, None)), seed))
        stack.extend((c, path + c.key) for c in node.children.values())
    return out


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return object


# What sglang's kv_events.py imports from sglang itself, for its publisher and port helpers
# only; stubbed so the structs load without `import sglang` (thousands of modules, torch).
_SGLANG_IMPORTS = ("sglang.srt.runtime_context", "sglang.srt.utils.network")


@cache
def _load_sglang_kv_events() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0], "srt", "disaggregation", "kv_events.py")
    added = [name for name in _SGLANG_IMPORTS if name not in sys.modules]
    for name in added:
        sys.modules[name] = _Stub(name)
    try:
        file_spec = importlib.util.spec_from_file_location("sglang_kv_events_under_test", path)
        assert file_spec is not None and file_spec.loader is not None
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
    finally:
        for name in added:
            del sys.modules[name]
    return module


def sglang_kv_events() -> types.ModuleType:
    """The installed sglang's `srt/disaggregation/kv_events.py`; skips without sglang or
    msgspec."""
    pytest.importorskip("msgspec")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    return _load_sglang_kv_events()


def sglang_decoder() -> Callable[[bytes], Any] | None:
    """SGLang's KVEventBatch decoder, or None without sglang or msgspec (for tests that check
    more than SGLang's decoding and should run without it)."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("msgspec") is None:
        return None
    import msgspec

    return msgspec.msgpack.Decoder(_load_sglang_kv_events().KVEventBatch).decode
