"""`event_loop_overlap`'s iteration: launch batch N+1 before processing batch N's result.

    build N+1 ─ launch N+1 ─ wait for N, process N ─ build N+2 ─ launch N+2 ─ ...
                    └─────── forward N+1 runs on the worker thread meanwhile ───────┘

Consequences the code below handles:
- Batch N+1 is built before N's tokens are known: its decode inputs are future placeholders
  (`Req.pending_token`), which the worker thread resolves; sampling indexes its seeded draws
  by KV length, not by `len(output_ids)`.
- A request found finished while processing N is already in N+1: that extra sample is
  dropped (`req.finished()`), and the slot it used is freed with the rest of its KV.
- A request retracted while building N+1 was in forward N: its sample from N is dropped
  (`retract_count` differs from launch time) and recomputed when it resumes.
- A forward in flight may read the `req_to_token` row of a request that just finished or was
  retracted, so freed rows are held until that forward is known to be done.
- A batch whose requests need their latest token on the host first (penalties count output
  tokens) processes the previous result before it is built.
Both loops produce the same tokens; `--disable-overlap-schedule` selects the normal one.
"""

from __future__ import annotations

from typing import Any

from torch.profiler import record_function

from managers.overlap_worker import OverlapWorker
from managers.schedule_batch import BatchLaunch


class IdleTracker:
    """How long the model worker waited for the scheduler between consecutive forwards."""

    def __init__(self) -> None:
        self.idle_s = 0.0
        self.busy_s = 0.0
        self._prev_end: float | None = None
        self._mark = (0.0, 0.0)

    def forward(self, start: float, end: float) -> None:
        """Normal loop: a forward ran from `start` to `end`."""
        if self._prev_end is not None:
            self.idle_s += start - self._prev_end
        self.busy_s += end - start
        self._prev_end = end

    def record(self, wait_s: float, forward_s: float, continuous: bool) -> None:
        """Overlap loop: the worker thread's own wait and forward times."""
        if continuous:
            self.idle_s += wait_s
        self.busy_s += forward_s

    def pause(self) -> None:
        """No batch this iteration: the gap until the next forward is not the scheduler's."""
        self._prev_end = None

    def fraction_since_mark(self) -> float:
        idle = self.idle_s - self._mark[0]
        busy = self.busy_s - self._mark[1]
        self._mark = (self.idle_s, self.busy_s)
        return idle / (idle + busy) if idle + busy > 0 else 0.0


class SchedulerOverlapMixin:
    def _init_overlap(self: Any) -> None:
        self.overlap = not self.server_args.disable_overlap_schedule
        self.idle_tracker = IdleTracker()
        self.pending: BatchLaunch | None = None
        self.pending_rows: list[int] = []  # rows to release once `pending`'s forward is done
        self.launched_last_step = False
        if self.overlap:
            self.forward_worker = OverlapWorker(self.worker, self.max_running_requests)
            self.req_to_token_pool.hold_frees = True

    def step_overlap(self: Any) -> bool:
        if self.pending is not None and any(
            r.needs_sync() for r in self.pending.reqs if not r.finished()
        ):
            self._finish_pending()
            self._release_held_rows()
        launched: BatchLaunch | None = None
        with record_function("scheduler"):
            batch = self.get_next_batch_to_run()
            self.last_batch = batch
            if batch is not None:
                self.was_idle = False
                placeholders = self.forward_worker.launch(batch.model_worker_batch())
                launched = batch.launch_record(placeholders)
                launched.continuous = self.launched_last_step
                self.forward_ct += 1
                held = self.req_to_token_pool.take_held()
                if self.pending is None:
                    self.req_to_token_pool.release(held)  # nothing else in flight
                else:
                    self.pending_rows += held  # freed while `pending` was in flight
        ran = batch is not None or self.pending is not None
        if self.pending is not None:
            self._finish_pending()
        if launched is None:
            self._release_held_rows()
            self.idle_tracker.pause()
        self.pending = launched
        self.launched_last_step = launched is not None
        if not ran:
            self._on_maybe_idle()
        return ran

    def _finish_pending(self: Any) -> None:
        """Wait for the pending forward, then process its result."""
        launch, self.pending = self.pending, None
        done = self.forward_worker.wait_result()
        self.req_to_token_pool.release(self.pending_rows)
        self.pending_rows = []
        self.idle_tracker.record(done.wait_s, done.forward_s, launch.continuous)
        with record_function("scheduler"):
            self.process_batch_result(launch, done.result)

    def _release_held_rows(self: Any) -> None:
        self.req_to_token_pool.release(self.req_to_token_pool.take_held())
