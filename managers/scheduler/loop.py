"""`Scheduler`: one iteration of the event loop, over four named parts.

    intake   (intake.py)   new requests, validation, aborts, grammar and disaggregation queues
    prefill  (prefill.py)  the next prefill batch: policy order + PrefillAdder budgets
    decode   (decode.py)   the next decode batch: retraction + the new-token ratio
    output   (output.py)   a forward's result applied to its requests, emitted, logged

They share `Queues` (where each request is) and `KVManager` (who owns each KV slot), and
tell the clients through one `Emitter` (emitter.py), built first so that every part,
the disaggregation side included, gets what it needs in its constructor. A step:
poll the waiting intake queues, build the next batch (prefill first, else decode), run it,
process its result. `step_normal` runs one batch after the other: the default on CPU, where
the forward is synchronous and its threads take every core, so a scheduler thread running
beside it only slows it (`ServerArgs.overlap_schedule()`; `--enable-overlap-schedule` /
`--disable-overlap-schedule` choose). On GPU by default `step_overlap` launches batch N+1
before processing batch N's result:

    build N+1 ─ launch N+1 ─ wait for N, process N ─ build N+2 ─ launch N+2 ─ ...
                    └─────── forward N+1 runs on the worker thread meanwhile ───────┘

Consequences handled here and in `Output.process`:
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
  tokens, grammars mask by them) processes the previous result before it is built.
Both loops produce the same tokens.

The worker is anything with `model_config`, `get_memory_pool()` and
`forward_batch_generation(ModelWorkerBatch)`: the real `ModelWorker`, or a scripted test double.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import record_function

from constrained import create_grammar_backend
from constrained.limits import GrammarLimits
from disagg.port import create_disagg
from managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    MemoryIntegrity,
    SchedulerState,
    TokenizedGenerateReqInput,
)
from managers.overlap_worker import OverlapWorker
from managers.schedule_batch import BatchLaunch, SamplingCache, ScheduleBatch
from managers.scheduler.deadlines import Deadlines
from managers.scheduler.decode import DecodePlanner
from managers.scheduler.disagg_port import Port
from managers.scheduler.emitter import Emitter
from managers.scheduler.intake import Intake
from managers.scheduler.output import Output
from managers.scheduler.prefill import PrefillPlanner
from managers.scheduler.queues import Queues
from mem_cache.integrity import MemoryLeakError
from mem_cache.kv_event_publisher import KVEventStream
from mem_cache.kv_manager import KVManager
from mem_cache.registry import PREFIX_CACHES
from srt.server_args import ServerArgs
from srt.speculative import create_draft_controller

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        worker: Any,
        output_sink: Callable[[BatchTokenIDOut], None],
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        tp_rank: int = 0,
        raise_on_leak: bool = True,
    ) -> None:
        """`clock` times the deadlines (a tensor-parallel rank's reads rank 0's step time);
        `tp_rank` names this rank in its state and its integrity-check errors;
        `raise_on_leak`: see `check_memory`."""
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.worker = worker
        cfg = worker.model_config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.context_len: int = cfg.context_len
        rows, allocator = worker.get_memory_pool()
        self.kv = KVManager(rows, allocator, _prefix_cache(server_args))
        self.kv_events = KVEventStream.create(server_args.kv_events_config, self.kv.tree)
        self.queues = Queues()
        self.grammar_backend = create_grammar_backend(
            server_args.grammar_backend,
            tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            cache_size=server_args.grammar_cache_size,
            compile_threads=server_args.grammar_compile_threads,
            limits=GrammarLimits.from_server_args(server_args),
            isolation=server_args.grammar_compile_isolation,
        )
        self.emitter = Emitter(output_sink, tokenizer, self.context_len)
        self.drafts = create_draft_controller(server_args, self.context_len)
        self.decode = DecodePlanner(
            self.queues,
            self.kv,
            self.emitter,
            server_args.schedule_conservativeness,
            self.drafts,
        )
        self.deadlines = Deadlines(server_args.waiting_timeout, server_args.running_timeout, clock)
        port = Port(self.queues, self.kv, self.emitter, self.deadlines)
        self.disagg = create_disagg(server_args, port, worker)
        # An embedding server's pooling (`--is-embedding`; None when generating).
        pooling = getattr(worker, "pooling", None)
        self.output = Output(
            self.queues,
            self.kv,
            self.emitter,
            self.disagg.take_finished,
            server_args.decode_log_interval,
            pooling,
            self.drafts,
        )
        self.prefill = PrefillPlanner(
            self.queues, self.kv, self.decode, self.output, server_args, self.deadlines
        )
        self.intake = Intake(
            self.queues,
            self.kv,
            self.emitter,
            self.disagg,
            server_args,
            cfg,
            self.grammar_backend,
            self.deadlines,
            pooling,
        )
        # The overlap loop: the launched batch whose result is not processed yet.
        self.overlap = server_args.overlap_schedule()
        self.pending: BatchLaunch | None = None
        self.pending_rows: list[int] = []  # rows to release once `pending`'s forward is done
        self.launched_last_step = False
        if self.overlap:
            self.forward_worker = OverlapWorker(worker, self.kv.max_rows)
        self.kv.hold_row_frees(self.overlap)
        self.sampling_cache = SamplingCache()
        self.was_idle = True
        self.raise_on_leak = raise_on_leak
        self.memory_check = MemoryIntegrity()

    # ---- messages ------------------------------------------------------------------
    def handle(self, msg: Any) -> Any:
        """Apply one message; return the reply a control message asks for (else None)."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.intake.add(msg)
        elif isinstance(msg, AbortReq):
            self.intake.abort(msg)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            text = "Cache flushed." if ok else "Cache not flushed: requests are running or waiting."
            return FlushCacheReqOutput(ok, text)
        elif isinstance(msg, GetInternalStateReq):
            return GetInternalStateReqOutput(self.internal_state())
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")
        return None

    def flush_cache(self) -> bool:
        q = self.queues
        # Requests waiting on a disaggregation peer hold slots outside the queues (a decode
        # server's preallocated KV, which the peer may be writing).
        if q.waiting or q.running or q.chunked is not None or self.disagg:
            logger.warning("Cache not flushed: there are running or waiting requests.")
            return False
        self.kv.flush()  # idle: every slot is free or in the tree
        self.decode.ratio.reset()
        logger.info("Cache flushed.")
        return True

    # ---- one iteration -------------------------------------------------------------
    def is_idle(self) -> bool:
        # A prefill batch that just ran is merged into the running batch only at the next
        # step, so until then `last_batch` still holds live requests.
        return not self.queues.holds_requests() and self.pending is None and not self.intake

    def step(self, grammar_done: list[int] | None = None) -> bool:
        """One iteration of the configured loop; return whether anything ran. What the step
        (and the messages before it) did to the prefix tree goes out as one KV-event batch.
        `grammar_done`: see `Intake.poll`."""
        if self.overlap:
            ran = self.step_overlap(grammar_done)
        else:
            ran = self.step_normal(grammar_done)
        self.kv_events.publish_step()
        return ran

    def step_normal(self, grammar_done: list[int] | None = None) -> bool:
        """Build, run, process, in sequence."""
        with record_function("scheduler"):
            built_at = time.perf_counter()
            batch = self.next_batch(grammar_done)
            self.queues.last_batch = batch
            if batch is None:
                self.output.idle_tracker.pause()
                self._on_maybe_idle()
                return False
            self.was_idle = False
            worker_batch = self._worker_batch(batch)
        start = time.perf_counter()
        result = self.worker.forward_batch_generation(worker_batch)
        end = time.perf_counter()
        self.output.idle_tracker.forward(start, end)
        self.output.forward_ct += 1
        with record_function("scheduler"):
            self.output.process(batch.launch_record(), result)
        self._time_step(batch, worker_batch, time.perf_counter() - built_at)
        return True

    def step_overlap(self, grammar_done: list[int] | None = None) -> bool:
        """Build and launch batch N+1, then process batch N while N+1 runs (module doc)."""
        pending = self.pending
        if pending is not None and (
            # Drafts continue the latest tokens; grammars and penalties read them too.
            self.drafts is not None
            or not pending.argmax_only
            and any(r.needs_sync() for r in pending.reqs if not r.finished())
        ):
            self._finish_pending()  # building needs their latest tokens on the host
            self.kv.release_rows(self.kv.take_held_rows())
        launched: BatchLaunch | None = None
        with record_function("scheduler"):
            built_at = time.perf_counter()
            batch = self.next_batch(grammar_done)
            self.queues.last_batch = batch
            if batch is not None and batch.drafts is not None:
                # A verify step's result decides what the next batch holds: run it through.
                self.was_idle = False
                worker_batch = self._worker_batch(batch)
                result = self.worker.forward_batch_generation(worker_batch)
                self.output.forward_ct += 1
                self.output.process(batch.launch_record(), result)
                self._time_step(batch, worker_batch, time.perf_counter() - built_at)
                self.kv.release_rows(self.kv.take_held_rows())  # no forward is in flight
                self.launched_last_step = False
                return True
            if batch is not None:
                self.was_idle = False
                worker_batch = self._worker_batch(batch)
                placeholders = self.forward_worker.launch(worker_batch)
                launched = batch.launch_record(placeholders)
                launched.built_at = built_at
                launched.argmax_only = worker_batch.sampling_info is None
                launched.continuous = self.launched_last_step
                self.output.forward_ct += 1
                held = self.kv.take_held_rows()
                if self.pending is None:
                    self.kv.release_rows(held)  # nothing else in flight
                else:
                    self.pending_rows += held  # freed while `pending` was in flight
        ran = batch is not None or self.pending is not None
        if self.pending is not None:
            self._finish_pending()
        if launched is None:
            self.kv.release_rows(self.kv.take_held_rows())
            self.output.idle_tracker.pause()
        self.pending = launched
        self.launched_last_step = launched is not None
        if not ran:
            self._on_maybe_idle()
        return ran

    def _finish_pending(self) -> None:
        """Wait for the pending forward, then process its result."""
        assert self.pending is not None
        launch, self.pending = self.pending, None
        done = self.forward_worker.wait_result()
        self.kv.release_rows(self.pending_rows)
        self.pending_rows = []
        self.output.idle_tracker.record(done.wait_s, done.forward_s, launch.continuous)
        with record_function("scheduler"):
            self.output.process(launch, done.result)
        if self.drafts is not None and launch.forward_mode.is_decode():
            # While drafts are on, building waits for this result: the step ran serially.
            self.drafts.timed(len(launch.reqs), time.perf_counter() - launch.built_at)

    def _time_step(self, batch: ScheduleBatch, worker_batch: Any, seconds: float) -> None:
        """Decode and verify steps' times, from building the batch to processing its result
        (a verify step's drafting and per-row sampling and bookkeeping are its own cost, not
        only its forward), feed the draft controller's cost fit."""
        if self.drafts is not None and not batch.forward_mode.is_extend():
            self.drafts.timed(len(worker_batch.input_ids), seconds)

    def next_batch(self, grammar_done: list[int] | None = None) -> ScheduleBatch | None:
        """Poll the intake queues; merge the last prefill into the running requests; then a
        new prefill batch if one can be built, else a decode step."""
        q = self.queues
        self.intake.poll(grammar_done)
        last = q.last_batch
        if last is not None and last.forward_mode.is_extend():
            keep = last.unfinished()
            # A MIXED batch already holds every running request.
            q.running = keep if last.forward_mode.is_mixed() else q.running + keep
        q.last_batch = None
        batch = self.prefill.build()
        return batch if batch is not None else self.decode.build()

    def _worker_batch(self, batch: ScheduleBatch) -> Any:
        return batch.model_worker_batch(
            self.vocab_size, self.eos_token_ids, self.grammar_backend, self.sampling_cache
        )

    def _on_maybe_idle(self) -> None:
        if not self.was_idle and self.is_idle():
            self.was_idle = True
            self.check_memory()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and self.is_idle():
                return
        raise RuntimeError(f"scheduler not idle after {max_steps} steps")

    # ---- state -----------------------------------------------------------------------
    def check_memory(self) -> None:
        """Prove no KV slot is leaked or double-owned; record the verdict for server info.

        Raises `MemoryLeakError` unless `raise_on_leak` is off (the server process logs the
        error and reports it through `/get_server_info` instead of dying)."""
        try:
            self.kv.check_integrity(r.kv for r in self.queues.running)
        except MemoryLeakError as e:
            self.memory_check = MemoryIntegrity(ok=False, error=str(e), time=time.time())
            where = f" on TP rank {self.tp_rank}" if self.tp_rank else ""
            logger.error("Memory integrity check failed%s: %s", where, e)
            if self.raise_on_leak:
                raise
        else:
            self.memory_check = MemoryIntegrity(ok=True, error=None, time=time.time())

    def internal_state(self) -> SchedulerState:
        if self.is_idle():
            self.check_memory()  # cheap, and the freshest answer when the server is idle
        idle = self.output.idle_tracker
        return SchedulerState(
            num_running_reqs=self.queues.num_running(),
            num_queue_reqs=len(self.queues.waiting),
            token_usage=self.kv.token_usage(),
            max_total_tokens=self.kv.total_tokens,
            max_running_requests=self.kv.max_rows,
            num_retracted_reqs=self.decode.num_retracted_reqs,
            num_aborted_reqs=self.intake.num_aborted_reqs,
            overlap_schedule=self.overlap,
            worker_idle_s=idle.idle_s,
            worker_busy_s=idle.busy_s,
            pid=os.getpid(),
            new_token_ratio=self.decode.ratio.value,
            forward_ct=self.output.forward_ct,
            memory_integrity=self.memory_check,
            tp_rank=self.tp_rank,
            grammar_cache_entries=self.grammar_backend.num_cached() if self.grammar_backend else 0,
            num_grammar_queue_reqs=len(self.intake.grammar_queue),
            avg_spec_accept_length=self.output.spec.accept_length(),
            spec_draft_tokens=self.output.spec.drafted,
            spec_accepted_tokens=self.output.spec.accepted,
        )


def _prefix_cache(server_args: ServerArgs) -> Any:
    if server_args.disable_radix_cache:
        return PREFIX_CACHES.create("chunk", server_args.page_size)
    return PREFIX_CACHES.create(
        "radix", server_args.page_size, eviction_policy=server_args.radix_eviction_policy
    )
