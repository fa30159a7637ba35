"""`Queues`: where every request the scheduler holds is, shared by its parts.

    waiting ──(PrefillPlanner)──▶ last_batch (a prefill) ──(next step: merged)──▶ running
       ▲          chunked: a prompt between two chunks (also in last_batch while it runs)
       └──────────────────────(DecodePlanner retracts)─────────────────────────────┘

Requests waiting for a grammar or for their disaggregation peer are held by `Intake` and the
disaggregation side until they join `waiting` (or, on the decode side, `running`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from managers.req import Req
    from managers.schedule_batch import ScheduleBatch


@dataclass
class Queues:
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)  # decoding
    chunked: Req | None = None
    last_batch: ScheduleBatch | None = None  # the batch launched last step

    def num_running(self) -> int:
        """Admitted and unfinished. A prefill still in flight counts: in the overlap loop its
        requests join `running` only a step later, and a load report must not drop them."""
        return sum(not r.finished() for r in self.in_flight())

    def holds_requests(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.last_batch)

    def in_flight(self) -> Iterator[Req]:
        """Every admitted request: running, chunked, or in the prefill launched last step."""
        seen = set()
        extra = [self.chunked] if self.chunked is not None else []
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            extra += last.reqs
        for req in self.running + extra:
            if id(req) not in seen:
                seen.add(id(req))
                yield req
