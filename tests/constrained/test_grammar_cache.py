"""The compiled-grammar cache is bounded: an LRU of `--grammar-cache-size`
futures. Evicting an entry must not disturb a request that already holds its future (still
compiling, or waiting in the grammar queue) or its matcher."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from constrained import create_grammar_backend
from constrained.base_grammar_backend import (
    DEFAULT_CACHE_SIZE,
    BaseGrammarBackend,
    GrammarKey,
)
from tests.constrained.helpers import AcceptAllMatcher

UNIQUE_SCHEMAS = 2000


def schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"f{i}": {"type": "integer"}}})


def key(i: int) -> GrammarKey:
    return GrammarKey("json_schema", schema(i))


class Compiled:
    def __init__(self, key: GrammarKey) -> None:
        self.key = key


class FakeBackend(BaseGrammarBackend):
    """Compiles instantly, or waits for `gate` when it is given."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        super().__init__(cache_size=cache_size)
        self.gate: threading.Event | None = None
        self.compiles = 0

    def compile(self, key: GrammarKey) -> Compiled:
        self.compiles += 1
        if self.gate is not None:
            assert self.gate.wait(10)
        return Compiled(key)

    def new_matcher(self, compiled: Compiled) -> AcceptAllMatcher:
        return AcceptAllMatcher(compiled)

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 1)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        pass


def test_unique_schemas_never_grow_the_cache_past_its_size() -> None:
    backend = FakeBackend(cache_size=16)
    for i in range(UNIQUE_SCHEMAS):
        backend.compile_async(key(i)).result()
        assert len(backend.cache) <= 16
    assert len(backend.cache) == 16
    assert [key(i) in backend.cache for i in range(UNIQUE_SCHEMAS - 16, UNIQUE_SCHEMAS)] == [
        True
    ] * 16


def test_default_size() -> None:
    assert FakeBackend().cache.capacity == DEFAULT_CACHE_SIZE == 64


def test_same_schema_shares_one_compile_and_stays_while_used() -> None:
    backend = FakeBackend(cache_size=2)
    first = backend.compile_async(key(0))
    backend.compile_async(key(1))
    assert backend.compile_async(key(0)) is first  # a hit makes key 0 the most recent
    backend.compile_async(key(2))  # evicts key 1, the least recently used
    assert key(0) in backend.cache and key(1) not in backend.cache
    assert backend.compile_async(key(0)) is first
    backend.compile_async(key(1)).result()
    assert backend.compiles == 4  # 0, 1, 2, then 1 again after its eviction


def test_evicting_a_compiling_future_keeps_it_valid() -> None:
    backend = FakeBackend(cache_size=1)
    backend.gate = threading.Event()
    pending = backend.compile_async(key(0))  # held by its request in the grammar queue
    backend.compile_async(key(1))  # evicts key 0 while it is still compiling
    assert key(0) not in backend.cache and not pending.done()
    backend.gate.set()
    assert pending.result(10).key == key(0)


def test_evicting_a_compiled_grammar_keeps_matchers_working() -> None:
    backend = FakeBackend(cache_size=1)
    matcher = backend.new_matcher(backend.compile_async(key(0)).result())
    backend.compile_async(key(1)).result()
    assert key(0) not in backend.cache
    assert matcher.compiled.key == key(0) and matcher.accept_token(5)


def test_zero_size_disables_sharing_not_compiling() -> None:
    backend = FakeBackend(cache_size=0)
    assert backend.compile_async(key(0)).result().key == key(0)
    assert len(backend.cache) == 0


# ---- the real xgrammar backend with the default model's tokenizer --------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> Any:
    pytest.importorskip("xgrammar")
    from srt.model_loader.sources import get_tokenizer

    return get_tokenizer(default_model_path)


def xgrammar_backend(tokenizer: Any, cache_size: int) -> Any:
    vocab_size = len(tokenizer)
    backend = create_grammar_backend(
        "xgrammar", tokenizer, vocab_size, [tokenizer.eos_token_id], cache_size=cache_size
    )
    assert backend is not None
    return backend


def test_xgrammar_2000_unique_schemas_keep_at_most_cache_size(tokenizer: Any) -> None:
    backend = xgrammar_backend(tokenizer, cache_size=8)
    for i in range(UNIQUE_SCHEMAS):
        backend.compile_async(key(i)).result()
    assert len(backend.cache) == 8


def test_xgrammar_compiler_keeps_no_second_cache(tokenizer: Any) -> None:
    """xgrammar's compiler has its own cache, unbounded by default: with it, the 2000 grammars
    the LRU evicted would all stay alive there."""
    backend = xgrammar_backend(tokenizer, cache_size=8)
    for i in range(100):
        backend.compile_async(key(i)).result()
    assert backend.compiler.get_cache_size_bytes() == 0


def test_xgrammar_evicted_grammar_keeps_its_matcher(tokenizer: Any) -> None:
    backend = xgrammar_backend(tokenizer, cache_size=1)
    matcher = backend.new_matcher(backend.compile_async(key(0)).result())
    backend.compile_async(key(1)).result()
    assert key(0) not in backend.cache
    for token in tokenizer.encode('{"f0": 12}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
