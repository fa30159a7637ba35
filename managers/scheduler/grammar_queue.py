"""Requests whose grammar is still compiling. Compiles run on the grammar backend's workers;
the scheduler polls this queue once per step and moves requests on when their grammar is
ready (or finishes them with a 400 when it is invalid, over a cap or too slow), so other
requests keep running meanwhile.

A request that leaves before its grammar is ready (timed out or aborted) cancels the compile
if no other request waits for it: one that has not started is dropped, one that runs in a
compile process is stopped (its worker killed), and one on a compile thread runs to its end
(the compiler cannot be interrupted) and its result stays cached for the next request with
the same grammar. A client may have at most `--grammar-max-pending-per-client` distinct
grammars waiting here at once (`pending_for`); a request over that gets a 429.

Tensor parallelism: compiles finish at different moments on each rank, so readiness is
decided once, by rank 0 (`done_seqs`: which compiles are done, after the short idle wait),
and applied on every rank (`pop_done(..., done=...)`: a rank waits for a compile rank 0 saw
done, which is deterministic, so it gives the same result a moment later). Entries are named
by `seq`, the queue's count of adds, which is the same on every rank (a rid may come back
after an abort). Deadlines read `clock`, which on every rank is rank 0's step time. At tp=1
`pop_done` decides and applies in one call, as it always did."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from constrained.base_grammar_backend import GrammarError, GrammarKey, grammar_key
from constrained.limits import GrammarLimitError
from managers.io_struct import finish_abort
from managers.req import Req

# With nothing else to run, wait this long for a compile instead of spinning.
IDLE_WAIT_S = 0.005
# A compiler's message goes back to the client: short, and without the server's file paths.
MAX_MESSAGE_CHARS = 512
_FILE_PATH = re.compile(r"(?<![\w:/])(?:/[\w.+-]+){2,}\.\w+(?::\d+)?")


@dataclass(slots=True)
class _Entry:
    req: Req
    future: Future[Any]
    deadline: float
    seq: int  # the queue's count of adds: names the entry on every tensor-parallel rank
    client: str | None = None  # who sent the request (`TokenizedGenerateReqInput.client`)


class GrammarQueue:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.entries: list[_Entry] = []
        self.seq = 0

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, req: Req, future: Future[Any], client: str | None = None) -> None:
        self.seq += 1
        deadline = self.clock() + self.timeout_s
        self.entries.append(_Entry(req, future, deadline, self.seq, client))

    def pending_for(self, client: str, key: GrammarKey) -> int:
        """The other grammars `client`'s requests wait for (a request for one it already
        waits for adds no work). Counted from the entries, which every tensor-parallel rank
        holds alike, not from the compiles' progress, which differs between ranks."""
        keys = {grammar_key(e.req.sampling_params) for e in self.entries if e.client == client}
        keys.discard(key)
        return len(keys)

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [e for e in self.entries if pred(e.req)]
        self.entries = [e for e in self.entries if not pred(e.req)]
        self._cancel_unwanted(gone)
        return [e.req for e in gone]

    def _cancel_unwanted(self, gone: list[_Entry]) -> None:
        """Cancel the compiles of `gone` that no remaining request waits for (a no-op for
        one that already runs: the compiler cannot be interrupted)."""
        wanted = {id(e.future) for e in self.entries}
        for e in gone:
            if id(e.future) not in wanted:
                e.future.cancel()

    def done_seqs(self, block: bool) -> list[int]:
        """The entries whose compile is done (finished or failed), by `seq`: the readiness
        decision. With `block`, first wait up to `IDLE_WAIT_S` for one to finish."""
        if block and self.entries:
            wait([e.future for e in self.entries], IDLE_WAIT_S, FIRST_COMPLETED)
        return [e.seq for e in self.entries if e.future.done()]

    def pop_done(
        self,
        new_matcher: Callable[[Any], Any],
        block: bool = False,
        done: Collection[int] | None = None,
    ) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, now holding a matcher; requests finished with an
        error: invalid grammar or compile timeout).

        `done`: the entries (`seq`) whose compile counts as done, decided by rank 0's
        `done_seqs`; None decides here (`block` is then `done_seqs`'s). The others time out
        once `clock` passes their deadline."""
        done = set(self.done_seqs(block) if done is None else done)
        now = self.clock()
        ready: list[Req] = []
        failed: list[Req] = []
        keep: list[_Entry] = []
        expired: list[_Entry] = []
        for e in self.entries:
            if e.seq in done:
                # Rank 0 saw it done; here (another rank) it may still run: wait for it.
                try:
                    e.req.grammar = new_matcher(e.future.result())
                    ready.append(e.req)
                except GrammarLimitError as err:  # refused before compiling; names the field
                    e.req.finished_reason = finish_abort(err.message, 400)
                    failed.append(e.req)
                except GrammarError as err:
                    e.req.finished_reason = finish_abort(_message("Invalid grammar", err), 400)
                    failed.append(e.req)
                except Exception as err:  # noqa: BLE001 - one bad grammar must not stop the server
                    message = _message("Grammar compilation failed", err)
                    e.req.finished_reason = finish_abort(message, 400)
                    failed.append(e.req)
            elif now > e.deadline:
                e.req.finished_reason = finish_abort(
                    f"Grammar compilation did not finish within {self.timeout_s:g} s.", 400
                )
                failed.append(e.req)
                expired.append(e)
            else:
                keep.append(e)
        self.entries = keep
        self._cancel_unwanted(expired)
        return ready, failed


def _message(what: str, err: BaseException) -> str:
    text = _FILE_PATH.sub("<path>", str(err) or type(err).__name__)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + " ..."
    return f"{what}: {text}"
