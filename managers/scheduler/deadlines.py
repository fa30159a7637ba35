"""`Deadlines`: every request's time limits in one heap, checked once per step.

Three limits, each an entry pushed when its clock starts:

    the client's `timeout`   arrival ──────────────────────────▶ finish
    --waiting-timeout        arrival ──▶ first admission
    --running-timeout                    first admission ──────▶ finish

`expired()` pops only the entries that are due, so a step where nothing expires costs one
look at the heap's top. Entries that no longer apply (the request finished, or a waiting
limit of a request since admitted) are dropped when they come up, and the heap is compacted
when such leftovers outnumber the live entries. A retracted request keeps its admission time:
the waiting limit covers only the wait before the first admission.

What an expiry means for the client: before admission the server could not serve the request
in time, an overload like a full queue, so it is a 503; after admission the request finishes
as an abort with the output so far, like SGLang's `/abort_request`.

`clock` is `time.monotonic` at tp=1; on a tensor-parallel rank it is the `StepClock` that
reads rank 0's time of the current step (`managers/tp_sync.py`), so every rank expires the
same requests at the same step.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from managers.io_struct import FinishReason, finish_abort

if TYPE_CHECKING:
    from managers.req import Req

Limit = Literal["timeout", "waiting", "running"]
# Compact the heap once it holds more than this many entries and twice the live ones.
MIN_COMPACT_LEN = 1024


@dataclass(order=True, slots=True)
class _Entry:
    due: float
    seq: int
    req: Req = field(compare=False)
    limit: Limit = field(compare=False)


class Deadlines:
    def __init__(
        self,
        waiting_timeout: float | None,
        running_timeout: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.waiting_timeout = waiting_timeout
        self.running_timeout = running_timeout
        self.clock = clock
        self.heap: list[_Entry] = []
        self.seq = 0
        self.compact_at = MIN_COMPACT_LEN

    def __len__(self) -> int:
        return len(self.heap)

    def arrived(self, req: Req) -> None:
        now = self.clock()
        req.admission.arrival = now
        if req.admission.timeout is not None:
            self._push(now + req.admission.timeout, req, "timeout")
        if self.waiting_timeout is not None:
            self._push(now + self.waiting_timeout, req, "waiting")

    def admitted(self, req: Req) -> None:
        """The request joined a prefill batch; only the first admission starts a clock."""
        if req.admission.admitted is not None:
            return
        now = self.clock()
        req.admission.admitted = now
        if self.running_timeout is not None:
            self._push(now + self.running_timeout, req, "running")

    def expired(self) -> list[tuple[Req, FinishReason]]:
        """Requests past a deadline, each once, with the finish reason to give them."""
        if not self.heap or self.heap[0].due > (now := self.clock()):
            return []
        out: dict[int, tuple[Req, FinishReason]] = {}
        while self.heap and self.heap[0].due <= now:
            entry = heapq.heappop(self.heap)
            if self._applies(entry) and id(entry.req) not in out:
                out[id(entry.req)] = (entry.req, self._reason(entry))
        return list(out.values())

    def _push(self, due: float, req: Req, limit: Limit) -> None:
        self.seq += 1
        heapq.heappush(self.heap, _Entry(due, self.seq, req, limit))
        if len(self.heap) > self.compact_at:
            self.heap = [e for e in self.heap if self._applies(e)]
            heapq.heapify(self.heap)
            self.compact_at = max(MIN_COMPACT_LEN, 2 * len(self.heap))

    @staticmethod
    def _applies(entry: _Entry) -> bool:
        req = entry.req
        if req.finished():
            return False
        return entry.limit != "waiting" or req.admission.admitted is None

    def _reason(self, entry: _Entry) -> FinishReason:
        adm = entry.req.admission
        if entry.limit == "timeout":
            assert adm.timeout is not None
            limit = f"{adm.timeout:g} s (the request's timeout)"
        elif entry.limit == "waiting":
            limit = f"{self.waiting_timeout:g} s (--waiting-timeout)"
        else:
            limit = f"{self.running_timeout:g} s of running (--running-timeout)"
        if adm.admitted is None:
            return finish_abort(f"Request timed out after {limit} waiting for admission.", 503)
        return finish_abort(f"Request timed out after {limit}.")
