"""Grammar backends: compile a constraint once (off the scheduler's thread), then give each
request its own matcher that tracks the tokens it has produced and masks the next ones.

Lifecycle of a constrained request in the scheduler:

    arrival ──▶ grammar queue (compile future pending; other requests keep running)
                    │ compiled: the request gets a matcher ──▶ waiting queue
                    │ compile error / timeout: finished with a 400 error
    each step: the matcher fills the request's row of the batch's vocabulary bitmask, the
    sampler applies it, and the sampled token is accepted into the matcher; when the
    grammar terminates, the request finishes.

Compiles are cached by (kind, spec), so concurrent requests with the same schema share one.
The cache is an LRU of `--grammar-cache-size` futures: a compiled grammar is the matcher's
automaton plus a token-mask cache over the vocabulary (from tens of kilobytes to megabytes,
growing with the vocabulary and the schema), so an unbounded cache lets clients with unique schemas exhaust the scheduler's
memory. Evicting only drops the cache's reference: a request in the grammar queue holds its
future, and a matcher holds its compiled grammar, so neither notices.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
DEFAULT_CACHE_SIZE = 64


class GrammarKey(NamedTuple):
    kind: str  # one of KINDS
    spec: str


class GrammarError(ValueError):
    """The constraint is invalid; the message is the compiler's."""


class BaseGrammarObject(ABC):
    """One request's matcher."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it."""

    @abstractmethod
    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `mask[row]`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""


class GrammarCache(OrderedDict[GrammarKey, "Future[Any]"]):
    """The `capacity` most recently used compile futures, by key (least recent first)."""

    def __init__(self, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        super().__init__()
        self.capacity = max(0, capacity)

    def hit(self, key: GrammarKey) -> Future[Any] | None:
        future = self.get(key)
        if future is not None:
            self.move_to_end(key)
        return future

    def add(self, key: GrammarKey, future: Future[Any]) -> None:
        self[key] = future
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class BaseGrammarBackend(ABC):
    def __init__(self, max_workers: int = 1, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache(cache_size)

    def compile_async(self, key: GrammarKey) -> Future[Any]:
        """A future of the compiled grammar (it raises `GrammarError` if invalid)."""
        future = self.cache.hit(key)
        if future is None:
            future = self.executor.submit(self.compile, key)
            self.cache.add(key, future)
        return future

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """Compile (runs on the executor thread); raise `GrammarError` if invalid."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> BaseGrammarObject: ...

    @abstractmethod
    def allocate_mask(self, batch_size: int) -> torch.Tensor: ...

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of `rows` get -inf, in place."""


class VocabMask:
    """The bitmask of one batch, filled from the matchers of its constrained rows."""

    def __init__(self, backend: BaseGrammarBackend, grammars: list[BaseGrammarObject | None]):
        self.backend = backend
        self.rows = [i for i, g in enumerate(grammars) if g is not None]
        self.mask = backend.allocate_mask(len(grammars))
        for i in self.rows:
            grammars[i].fill_vocab_mask(self.mask, i)  # type: ignore[union-attr]

    def apply(self, logits: torch.Tensor) -> None:
        self.backend.apply_mask(logits, self.mask.to(logits.device), self.rows)


def grammar_key(params: Any) -> GrammarKey | None:
    """The constraint a request's sampling params carry, if any (at most one is allowed)."""
    for kind in KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            return GrammarKey(kind, spec)
    return None
