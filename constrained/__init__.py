"""Constrained decoding. `create_grammar_backend` imports the chosen backend lazily."""

from __future__ import annotations

from typing import Any

from constrained.base_grammar_backend import BaseGrammarBackend

GRAMMAR_BACKENDS = ("xgrammar", "none")


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> BaseGrammarBackend | None:
    if name == "none" or tokenizer is None:
        return None
    if name == "xgrammar":
        from constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"unknown grammar backend {name!r}; choose from {GRAMMAR_BACKENDS}")
