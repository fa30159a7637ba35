"""The xgrammar backend: JSON schema, regex and EBNF via `xgrammar.GrammarCompiler`, one
`GrammarMatcher` per request, and xgrammar's bitmask kernels (CPU kernel on CPU, its GPU
kernel on GPU, chosen by `apply_token_bitmask_inplace`).

In compile processes (`compile_worker`), each worker builds the same compiler from the
serialized tokenizer info and sends each compiled grammar back serialized; it is rebuilt
here against this process's tokenizer info."""

from __future__ import annotations

import re
from multiprocessing.connection import Connection
from typing import Any

import torch
import xgrammar as xgr

from constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarError,
    GrammarKey,
)
from constrained.compile_pool import ProcessLanes


class XGrammarMatcher(BaseGrammarObject):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.tokenizer_info = info
        self.compiler = _compiler(info)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        return _compile(self.compiler, key)

    def process_lanes(self, workers: int) -> ProcessLanes:
        return ProcessLanes(
            f"{__name__}:compile_worker",
            self.tokenizer_info.serialize_json,  # ~0.3 s: only once a worker starts
            self.deserialize,
            GrammarError,
            workers,
            compile_here=self.compile,
        )

    def deserialize(self, data: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(data, self.tokenizer_info)

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)


def _compiler(info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    # Our LRU (`GrammarCache`) is the one cache: xgrammar's own is unbounded. Compile threads
    # share one compiler (with its cache off it keeps no state between compiles; vLLM shares
    # one the same way), a compile process has its own; `max_threads=1` is its parallelism
    # within one compile, ours is across compiles, and xgrammar releases the GIL while it
    # compiles.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _compile(compiler: xgr.GrammarCompiler, key: GrammarKey) -> xgr.CompiledGrammar:
    try:
        if key.kind == "json_schema":
            # Fixed whitespace: the model cannot wander off into endless blank space.
            return compiler.compile_json_schema(key.spec, any_whitespace=False)
        if key.kind == "regex":
            return compiler.compile_regex(key.spec)
        return compiler.compile_grammar(key.spec)
    except RuntimeError as e:  # xgrammar reports every parse error this way
        raise GrammarError(_compiler_message(e)) from None


# The largest compiled grammar a worker sends back serialized; a bigger one is compiled
# again in the scheduler (`ProcessLanes`). Tool schemas and short regexes stay well under
# it; past it, writing and reading the JSON took longer than compiling again in every shape
# measured (docs/benchmarks.md, "Grammar compiles in processes").
SHIP_BYTES = 256 << 10


def compile_worker(conn: Connection, tokenizer_info: str) -> None:
    """A compile process's loop: a `GrammarKey` in, `("ok", serialized grammar)`,
    `("compile here", None)` (too big to ship) or `("error", message)` out, until the pipe
    closes."""
    compiler = _compiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info))
    while True:
        try:
            key = conn.recv()
        except EOFError:
            return
        try:
            compiled = _compile(compiler, key)
            if compiled.memory_size_bytes > SHIP_BYTES:
                reply: tuple[str, str | None] = ("compile here", None)
            else:
                reply = ("ok", compiled.serialize_json())
        except GrammarError as e:
            reply = ("error", str(e))
        conn.send(reply)


# xgrammar's log prefix, `[12:00:00] /project/cpp/file.cc:123: `, which may appear once per
# nested error; and any other source path with a line number.
_LOG_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
_SOURCE_PATH = re.compile(r"\S*/\S+\.(?:cc|cpp|h|hpp):\d+:? ?")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")
# The end of a JSON-schema error quotes the whole schema back: the client has it already.
_ECHOED_SPEC = re.compile(r"\s*\.?\s*The JSON string is:.*", re.DOTALL)


def _compiler_message(e: RuntimeError) -> str:
    """The compiler's words, without xgrammar's log prefixes, C++ source locations, assertion
    text or an echo of the schema."""
    text = _ECHOED_SPEC.sub("", str(e).strip())
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_FAILED.sub("", text)
    return _SOURCE_PATH.sub("", text).strip()
