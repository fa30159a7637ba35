"""Constrained decoding. `create_grammar_backend` imports the chosen backend lazily."""

from __future__ import annotations

from typing import Any

from constrained.base_grammar_backend import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_COMPILE_THREADS,
    BaseGrammarBackend,
)
from constrained.limits import GrammarLimits
from srt.utils.registry import Registry


def _no_grammar_backend(*args: Any) -> None:
    """`--grammar-backend none`: the scheduler refuses constrained requests with a 400."""


GRAMMAR_BACKENDS: Registry[BaseGrammarBackend | None] = Registry("grammar backend")
GRAMMAR_BACKENDS.register(
    "xgrammar", "constrained.xgrammar_backend:XGrammarBackend", requires="xgrammar"
)
GRAMMAR_BACKENDS.register("none", _no_grammar_backend)


def create_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: list[int],
    cache_size: int = DEFAULT_CACHE_SIZE,
    compile_threads: int = DEFAULT_COMPILE_THREADS,
    limits: GrammarLimits | None = None,
    isolation: str = "process",
) -> BaseGrammarBackend | None:
    """The backend `name`, keeping at most `cache_size` compiled grammars, compiling on
    `compile_threads` workers (processes or threads: `isolation`) and refusing constraints
    over `limits`."""
    # Without a tokenizer (--skip-tokenizer-init) there is no vocabulary to compile against.
    if tokenizer is None:
        return None
    backend = GRAMMAR_BACKENDS.create(name, tokenizer, vocab_size, eos_token_ids)
    if backend is not None:  # the constructors take what the compiler needs; the rest is ours
        backend.configure(compile_threads, cache_size, limits, isolation)
    return backend
