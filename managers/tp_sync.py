"""Tensor-parallel lockstep: every rank's scheduler takes the same decisions because it takes
them from the same inputs, one `StepInput` per event-loop iteration.

    rank 0:  LocalStepSource (ZMQ drain, its clock, grammar readiness) ─┐
                                                                        ├─ broadcast_object
    rank r:  FollowerStepSource ◀───────────────────────────────────────┘   (control group)

Each rank then handles the same messages, sets its `StepClock` to rank 0's `now` and steps
its scheduler with rank 0's grammar decision. Everything else a step decides is already a
function of what came before: sampling seeds (`Intake.seed_rng`), the radix tree's LRU (a
counter, not time), retraction order, stop strings; and the sampled token ids themselves
come from rank 0 (`ModelWorker` broadcasts them). The step input goes out on every
iteration, even empty: that is the lockstep, and an idle rank 0, which wakes at least every
`IDLE_POLL_MS`, is also the followers' sign of life.

A collective that fails raises `TPPeerLost` (a peer died or stopped answering); the rank
then ends with `TP_PEER_LOST_EXIT_CODE` (`exit_if_peer_lost`), wherever it was raised: on the
scheduler thread, or on the forward thread and handed over by `OverlapWorker.wait_result`.

At tp=1 the local source alone is used, with a live clock and no grammar decision, which is
exactly the loop as it was before tensor parallelism.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from managers.io_struct import StepInput
from srt.distributed import TPGroup, TPPeerLost
from srt.utils.process import TP_PEER_LOST_EXIT_CODE

logger = logging.getLogger(__name__)

# An idle scheduler sleeps on its socket at most this long (to notice a dead parent, send
# its heartbeat, and, at tp > 1, give the followers a step).
IDLE_POLL_MS = 1000


class StepClock:
    """The scheduler's clock for deadlines. On a tensor-parallel rank it reads the time of
    the current step, set from rank 0's `StepInput.now`, so every rank sees the same time;
    a `live` clock (tp=1) reads `time.monotonic()` on each call, as the deadlines always did."""

    def __init__(self, live: bool = False) -> None:
        self.live = live
        self.now = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() if self.live else self.now

    def set(self, now: float) -> None:
        self.now = now


class StepSource(Protocol):
    def next_step(self, idle: bool) -> StepInput:
        """The next iteration's input; `idle` says the scheduler has nothing to do (rank 0
        may then block on its socket up to `IDLE_POLL_MS`)."""
        ...


class LocalStepSource:
    """tp=1, and rank 0's half at tp > 1: what arrived on the scheduler's socket since the
    last step (all of it, so that a burst joins one prefill batch; blocking up to
    `IDLE_POLL_MS` while idle), the time, and, when `grammar_done` is given, which grammar
    compiles count as done (`Intake.grammar_done_seqs`, which may wait briefly for one)."""

    def __init__(
        self,
        recv: zmq.Socket,
        grammar_done: Callable[[bool], list[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recv = recv
        self.grammar_done = grammar_done
        self.clock = clock

    def next_step(self, idle: bool) -> StepInput:
        msgs = self.receive(idle)
        # Decided before the time is read: a compile that finishes between the two times
        # out only if it was already past its deadline.
        done = None if self.grammar_done is None else self.grammar_done(not msgs)
        return StepInput(msgs, self.clock(), done)

    def receive(self, idle: bool) -> list[Any]:
        msgs: list[Any] = []
        # Nothing to run: sleep on the socket (bounded, to notice a dead parent).
        if idle and not self.recv.poll(IDLE_POLL_MS):
            return msgs
        while True:
            try:
                msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs


class LeaderStepSource:
    """Rank 0 at tp > 1: the local step input, sent to every other rank."""

    def __init__(self, local: StepSource, tp: TPGroup) -> None:
        self.local = local
        self.tp = tp

    def next_step(self, idle: bool) -> StepInput:
        return self.tp.broadcast_object(self.local.next_step(idle))


class FollowerStepSource:
    """Ranks > 0: rank 0's step input (blocks until it comes; at most `op_timeout_s`, after
    which the group counts rank 0 as lost)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def next_step(self, idle: bool) -> StepInput:
        return self.tp.broadcast_object(None)


def peer_lost(error: BaseException) -> TPPeerLost | None:
    """The `TPPeerLost` behind `error` (itself, or its cause or context, as when the forward
    thread's failure is re-raised on the scheduler thread), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, TPPeerLost):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def exit_if_peer_lost(error: BaseException, rank: int) -> None:
    """End the process with `TP_PEER_LOST_EXIT_CODE` if `error` comes from a lost peer: the
    group cannot recover (every later collective would fail or hang), so the rank goes, and
    the process watching the ranks names the one that failed first. Returns otherwise."""
    lost = peer_lost(error)
    if lost is None:
        return
    logger.error(
        "TP rank %d: lost a peer (%s); exiting with code %d.", rank, lost, TP_PEER_LOST_EXIT_CODE
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(TP_PEER_LOST_EXIT_CODE)
