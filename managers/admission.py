"""Refusing a request over `--max-queued-requests` where it arrives.

The scheduler decides admission exactly, but only between steps, and a prefill step can take
seconds on a small CPU: a refusal that waited for it would keep a client that could retry
elsewhere waiting for nothing. So the main process refuses a request at once when its own
counts say the queue is full. Every estimate here errs toward letting a request through;
the scheduler remains the final guard for what the front end cannot see (a queue bound by
KV memory rather than rows, requests in transit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from managers.errors import RequestError
from managers.io_struct import SchedulerStats


class FrontAdmission:
    """The main process's view of the scheduler's backlog: requests that wait for admission
    beyond the rows the next step can admit into (the scheduler's own measure)."""

    def __init__(self, bound: int | None, max_running: int) -> None:
        self.bound = bound
        self.max_running = max_running
        self.admitting = 0  # past this check, not yet handed to the scheduler (tokenizing)
        self.published_backlog: int | None = None  # from the latest stats
        self.sent_since = 0  # requests sent to the scheduler since those stats arrived
        self.ended_since = 0  # requests finished or aborted since

    def on_stats(self, stats: SchedulerStats) -> None:
        self.published_backlog = stats.num_backlog_reqs
        self.sent_since = self.ended_since = 0

    def on_ended(self, n: int) -> None:
        self.ended_since += n

    def backlog(self, unfinished: int) -> int:
        """The larger of two lower bounds on the backlog. `unfinished` requests here (sent
        and not finished) run at most `max_running` at a time, so the rest surely wait; and
        the scheduler's latest count, plus what was sent since, less what ended since.
        Requests sent before the stats but counted after them only lower the estimate."""
        surely = unfinished + self.admitting - self.max_running
        if self.published_backlog is None:
            return surely
        since = self.published_backlog + self.sent_since + self.admitting - self.ended_since
        return max(surely, since)

    @contextmanager
    def arrival(self, unfinished: int) -> Iterator[Arrival]:
        """Refuse with a 503 if the queue is full; otherwise count the request as arriving
        until it is sent (`Arrival.sent`) or the block ends."""
        if self.bound is not None:
            backlog = self.backlog(unfinished)
            if backlog >= self.bound:
                raise RequestError.overloaded(
                    f"The server is overloaded: {backlog} requests are waiting for admission "
                    f"(--max-queued-requests {self.bound}); retry later."
                )
        arrival = Arrival(self)
        self.admitting += 1
        try:
            yield arrival
        finally:
            if not arrival.done:
                self.admitting -= 1


class Arrival:
    """One request between the admission check and the scheduler."""

    def __init__(self, admission: FrontAdmission) -> None:
        self.admission = admission
        self.done = False

    def sent(self, num_requests: int) -> None:
        """It reached the scheduler as `num_requests` requests (n > 1 sends several)."""
        self.done = True
        self.admission.admitting -= 1
        self.admission.sent_since += num_requests
