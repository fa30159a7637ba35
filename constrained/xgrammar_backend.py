"""The xgrammar backend: JSON schema, regex and EBNF via `xgrammar.GrammarCompiler`, one
`GrammarMatcher` per request, and xgrammar's bitmask kernels (CPU kernel on CPU, its GPU
kernel on GPU, chosen by `apply_token_bitmask_inplace`)."""

from __future__ import annotations

import re
from typing import Any

import torch
import xgrammar as xgr

from constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarError,
    GrammarKey,
)


class XGrammarMatcher(BaseGrammarObject):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        try:
            if key.kind == "json_schema":
                # Fixed whitespace: the model cannot wander off into endless blank space.
                return self.compiler.compile_json_schema(key.spec, any_whitespace=False)
            if key.kind == "regex":
                return self.compiler.compile_regex(key.spec)
            return self.compiler.compile_grammar(key.spec)
        except RuntimeError as e:  # xgrammar reports every parse error this way
            raise GrammarError(_compiler_message(e)) from None

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)


def _compiler_message(e: RuntimeError) -> str:
    """Drop xgrammar's `[time] file.cc:line: ` prefix, keep the compiler's words."""
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        text = rest
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
