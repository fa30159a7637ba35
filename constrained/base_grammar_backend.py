"""Grammar backends: compile a constraint once (off the scheduler's thread), then give each
request its own matcher that tracks the tokens it has produced and masks the next ones.

Lifecycle of a constrained request in the scheduler:

    arrival ──▶ grammar queue (compile future pending; other requests keep running)
                    │ compiled: the request gets a matcher ──▶ waiting queue
                    │ over a cap / compile error / timeout: finished with a 400 error
    each step: the matcher fills the request's row of the batch's vocabulary bitmask, the
    sampler applies it, and the sampled token is accepted into the matcher; when the
    grammar terminates, the request finishes.

Compiles are cached by (kind, spec), so concurrent requests with the same schema share one.
The cache is an LRU of `--grammar-cache-size` futures: a compiled grammar is the matcher's
automaton plus a token-mask cache over the vocabulary (from tens of kilobytes to megabytes,
growing with the vocabulary and the schema), so an unbounded cache lets clients with unique schemas exhaust the scheduler's
memory. Evicting only drops the cache's reference: a request in the grammar queue holds its
future, and a matcher holds its compiled grammar, so neither notices.

Workers: compiles run on `--grammar-compile-threads` workers, in processes by default
(`--grammar-compile-isolation`; `constrained/compile_pool.py`), where a compile no request
waits for any more is killed. Only the scheduler's thread calls `compile_async` and touches
the cache; the workers only compile, so the cache needs no lock, and a key's future is shared
by every request that asks for it while it is cached (in flight or done). Before anything is
submitted the constraint is held to the caps of `constrained/limits.py`; one over them gets
a future that already failed. With two or more workers, one takes only small grammars
(`is_small`), so a flood of big schemas, each of which may take seconds, does not hold up a
short regex or a small tool schema. A compile no request waits for any more (`GrammarQueue`)
is cancelled: dropped if it has not started, stopped if it runs in a process; on a thread it
runs to its end. A cancelled or stopped future is a cache miss.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from constrained.compile_pool import CompileLanes, ThreadLanes, abandoned
from constrained.limits import GrammarLimitError, GrammarLimits, GrammarSize, check_grammar_limits

if TYPE_CHECKING:  # torch only types the masks here: the HTTP server imports this module
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
DEFAULT_CACHE_SIZE = 64
DEFAULT_COMPILE_THREADS = 4
# What tool calls and simple regexes send: such grammars usually compile in milliseconds, so
# they share one thread of their own. A crafted one can still take seconds: the thread bounds
# how long a small grammar waits behind big ones, it does not make the wait zero. Measured by
# `python -m bench.grammar_compile --probe optional-properties 64` (and `regex-alternations 50`).
SMALL_GRAMMAR_BYTES = 4096
SMALL_GRAMMAR_PROPERTIES = 64
SMALL_GRAMMAR_PATTERNS = 4


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

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts are checked by
        accepting them, then rolled back)."""


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
    def __init__(
        self,
        compile_threads: int = DEFAULT_COMPILE_THREADS,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: GrammarLimits | None = None,
    ) -> None:
        self._setup(compile_threads, cache_size, limits, "thread")

    def configure(
        self,
        compile_threads: int = DEFAULT_COMPILE_THREADS,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: GrammarLimits | None = None,
        isolation: str = "thread",
    ) -> None:
        """The server's settings (a backend's constructor takes only what its compiler
        needs); call it before the first compile."""
        self.shutdown()
        self._setup(compile_threads, cache_size, limits, isolation)

    def _setup(
        self, workers: int, cache_size: int, limits: GrammarLimits | None, isolation: str
    ) -> None:
        workers = max(1, workers)
        if isolation == "process":
            self.lanes = self.process_lanes(workers)
        else:
            self.lanes = ThreadLanes(self.compile, workers)
        self.cache = GrammarCache(cache_size)
        self.limits = limits or GrammarLimits()

    def process_lanes(self, workers: int) -> CompileLanes:
        """Lanes of worker processes; a backend whose compiled grammars can cross a process
        boundary overrides this."""
        raise ValueError(f"{type(self).__name__} compiles on threads only")

    def num_cached(self) -> int:
        """Compiled grammars kept for reuse (at most the cache's size)."""
        return len(self.cache)

    def shutdown(self) -> None:
        """Stop taking compiles; queued ones are dropped, running ones stopped where they
        run in processes."""
        self.lanes.shutdown()

    def compile_async(self, key: GrammarKey) -> Future[Any]:
        """A future of the compiled grammar. It raises `GrammarError` if the grammar is
        invalid and `GrammarLimitError` (at once, without compiling) if it is over a cap."""
        future = self.cache.hit(key)
        if future is not None and not abandoned(future):
            return future
        try:
            size = check_grammar_limits(key.kind, key.spec, self.limits)
        except GrammarLimitError as e:
            refused: Future[Any] = Future()
            refused.set_exception(e)
            return refused
        future = self.lanes.submit(key, is_small(size))
        self.cache.add(key, future)
        return future

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """Compile (on a compile thread); raise `GrammarError` if invalid."""

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


def is_small(size: GrammarSize) -> bool:
    return (
        size.bytes <= SMALL_GRAMMAR_BYTES
        and size.properties <= SMALL_GRAMMAR_PROPERTIES
        and size.patterns <= SMALL_GRAMMAR_PATTERNS
    )


def grammar_key(params: Any) -> GrammarKey | None:
    """The constraint a request's sampling params carry, if any (at most one is allowed)."""
    for kind in KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            return GrammarKey(kind, spec)
    return None
