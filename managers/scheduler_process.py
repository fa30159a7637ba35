"""The scheduler process: receive messages over ZMQ, step the scheduler, send outputs.

    tokenizer manager ──PUSH──▶ [scheduler_input]  scheduler  ──PUSH──▶ detokenizer
                      ◀─PUSH── (stats, control replies)

The loop drains every pending message before each step, so a burst of arrivals joins one
prefill batch; when the scheduler is idle it blocks on the socket instead of spinning.
Readiness (or the startup error) goes back to the parent through a pipe.

Tensor parallelism (`--tp-size N`): one such process per rank, each with its model shard.
Rank 0 alone has the sockets; every iteration it sends what it received, its time and its
grammar decisions to the other ranks (`managers/tp_sync.py`), and every rank runs the same
loop on that input, so their schedulers stay identical. The other ranks send nothing: no
outputs, no replies, no stats, no KV events. A state query gathers every rank's state.

Liveness: `SchedulerStats` goes out at least every `STATS_INTERVAL_S` while the loop turns
and every `IDLE_POLL_MS` while it is idle, and the main process reads it as a heartbeat
(`/health` fails once it stops). A `StepWatchdog` thread (one per rank) ends the process
with `WATCHDOG_EXIT_CODE` when one iteration (the messages it handles and its scheduler
step, a forward included) runs past `--watchdog-timeout`: it logs what was running and every
thread's stack first. A rank that loses a tensor-parallel peer exits with
`TP_PEER_LOST_EXIT_CODE`. The main process then fails the open requests with 503 and exits
1, as for any dead child.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from managers.io_struct import (
    BatchTokenIDOut,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerReady,
    SchedulerStats,
)
from managers.scheduler import Scheduler
from managers.tp_sync import (
    IDLE_POLL_MS,
    FollowerStepSource,
    LeaderStepSource,
    LocalStepSource,
    StepClock,
    StepSource,
    exit_if_peer_lost,
)
from srt import environ
from srt.distributed import TPGroup, TPInitError, TPSpec, init_tp_group
from srt.server_args import ServerArgs
from srt.utils.process import (
    WATCHDOG_EXIT_CODE,
    PortArgs,
    become_child,
    parent_alive,
    zmq_socket,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
__all__ = ["IDLE_POLL_MS", "STATS_INTERVAL_S", "SchedulerServer", "StepWatchdog"]


class StepWatchdog:
    """A thread that exits the process when one loop iteration runs past `timeout_s`.

    The loop brackets each iteration with `begin` / `end` (two attribute writes); the thread
    looks every `timeout_s / 4` (at most every second). A hung forward cannot be interrupted
    from Python, so the only safe way out is the whole process: `os._exit`, after a log
    line naming what hung (`describe()`) and every thread's stack."""

    def __init__(self, timeout_s: float, describe: Callable[[], str]) -> None:
        self.timeout_s = timeout_s
        self.describe = describe
        self.step_started: float | None = None
        self.poll_s = min(1.0, timeout_s / 4)

    def start(self) -> None:
        threading.Thread(target=self.run, name="radixrt-step-watchdog", daemon=True).start()

    def begin(self) -> None:
        self.step_started = time.monotonic()

    def end(self) -> None:
        self.step_started = None

    def run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self.fire(time.monotonic() - started)

    def fire(self, elapsed: float) -> None:
        try:
            what = self.describe()
        except Exception:  # noqa: BLE001 - whatever the state, the process must still exit
            what = "a scheduler step"
        logger.error(
            "Scheduler watchdog: %s has run %.1f s, past --watchdog-timeout %.1f s; "
            "dumping every thread's stack and exiting with code %d.",
            what,
            elapsed,
            self.timeout_s,
            WATCHDOG_EXIT_CODE,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(WATCHDOG_EXIT_CODE)


class SchedulerServer:
    """Owns the sockets (tensor-parallel rank 0 only) and the loop around one `Scheduler`."""

    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, tp: TPGroup | None = None
    ) -> None:
        from managers.model_worker import ModelWorker
        from srt.model_loader.sources import get_tokenizer

        tp = tp if tp is not None else TPGroup.single()
        self.server_args = server_args
        self.tp = tp
        worker = ModelWorker(server_args, tp=tp, hang_at_forward=environ.hang_at_forward())
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            # Every rank: stop strings and grammars need it, and they must agree.
            tokenizer = get_tokenizer(worker.model_config.model_path, server_args.tokenizer_path)
        self.clock = StepClock(live=tp.size == 1)
        self.send_to_tokenizer: zmq.Socket | None = None
        recv: zmq.Socket | None = None
        sink: Callable[[BatchTokenIDOut], None] = _drop_outputs
        scheduler_args = server_args
        if tp.is_leader:
            ctx = zmq.Context(2)
            recv = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
            to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
            self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
            sink = to_detokenizer.send_pyobj
        else:
            # The tree is the same on every rank; rank 0 alone publishes its events.
            scheduler_args = dataclasses.replace(server_args, kv_events_config=None)
        self.scheduler = Scheduler(
            scheduler_args,
            worker,
            sink,
            tokenizer,
            clock=self.clock,
            tp_rank=tp.rank,
            raise_on_leak=False,
        )
        self.source: StepSource
        if recv is None:
            self.source = FollowerStepSource(tp)
        elif tp.size == 1:
            self.source = LocalStepSource(recv)
        else:
            grammar_done = self.scheduler.intake.grammar_done_seqs
            self.source = LeaderStepSource(LocalStepSource(recv, grammar_done), tp)
        self.last_stats_time = 0.0
        self.last_stats_tokens = 0
        self.last_stats_load: tuple[int, int, int] | None = None
        self.watchdog = StepWatchdog(server_args.watchdog_timeout, self.describe_step)

    def ready_message(self) -> SchedulerReady:
        s = self.scheduler
        return SchedulerReady(
            model_path=s.worker.model_config.model_path,
            context_len=s.context_len,
            vocab_size=s.vocab_size,
            max_total_tokens=s.kv.total_tokens,
            max_running_requests=s.kv.max_rows,
            eos_token_ids=list(s.eos_token_ids),
            device=s.worker.device,
            pooling=s.output.pooling,
        )

    # ---- loop ----------------------------------------------------------------------
    def event_loop(self, parent_pid: int) -> None:
        """The same on every rank: rank 0's step input, its messages, one scheduler step."""
        self.watchdog.start()
        while True:
            step = self.source.next_step(idle=self.scheduler.is_idle())
            self.watchdog.begin()
            self.clock.set(step.now)
            for msg in step.msgs:
                self.handle(msg)
            ran = self.scheduler.step(grammar_done=step.grammar_done)
            idle = self.scheduler.is_idle()
            if self.send_to_tokenizer is not None:
                self.maybe_send_stats(force=idle)  # going idle: report it before the idle poll
            self.watchdog.end()
            if not ran:
                if not parent_alive(parent_pid):
                    logger.error("Parent process is gone; scheduler exits.")
                    return
                if not idle:
                    time.sleep(0.001)  # requests wait for memory; do not spin

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GetInternalStateReq):
            reply = self.gathered_state()
        else:
            reply = self.scheduler.handle(msg)
        if reply is not None and self.send_to_tokenizer is not None:
            self.send_to_tokenizer.send_pyobj(reply)

    def gathered_state(self) -> GetInternalStateReqOutput | None:
        """Every rank's state (a collective: every rank handles the same query), answered
        by rank 0; None on the other ranks."""
        states = self.tp.gather_objects(self.scheduler.internal_state())
        if states is None:
            return None
        return GetInternalStateReqOutput(states[0], ranks=states[1:])

    def describe_step(self) -> str:
        """What the loop was doing, for the watchdog's log line (read while it is stuck)."""
        s = self.scheduler
        text = f"a scheduler step ({s.output.forward_ct} forward(s) launched so far"
        batch = s.queues.last_batch
        if batch is not None:
            text += f"; the last a {batch.forward_mode.name} of {len(batch.reqs)} request(s)"
        return text + f"; {s.queues.num_running()} running, {len(s.queues.waiting)} waiting)"

    def maybe_send_stats(self, force: bool) -> None:
        """Stats at most every `STATS_INTERVAL_S`, and at once when the scheduler goes idle
        with something new to report (tokens, or a load that changed: /get_load reads the
        last report). The idle loop wakes every `IDLE_POLL_MS`, so an idle scheduler still
        sends one a second: the heartbeat."""
        now = time.perf_counter()
        elapsed = now - self.last_stats_time
        if elapsed < STATS_INTERVAL_S and not force:
            return
        s = self.scheduler
        out = s.output
        used_tokens = s.kv.total_tokens - s.kv.available_tokens()
        load = (s.queues.num_running(), len(s.queues.waiting), used_tokens)
        if (
            force
            and elapsed < STATS_INTERVAL_S
            and self.last_stats_tokens == out.num_generated_tokens
            and self.last_stats_load == load
        ):
            return  # idle and nothing new since the last report
        tokens = out.num_generated_tokens - self.last_stats_tokens
        self.last_stats_time, self.last_stats_tokens = now, out.num_generated_tokens
        self.last_stats_load = load
        self.send_to_tokenizer.send_pyobj(
            SchedulerStats(
                num_running_reqs=load[0],
                num_queue_reqs=load[1],
                token_usage=s.kv.token_usage(),
                cache_hit_rate=out.last_cache_hit_rate,
                gen_throughput=tokens / elapsed if elapsed > 0 else 0.0,
                num_retracted_reqs=s.decode.num_retracted_reqs,
                max_total_tokens=s.kv.total_tokens,
                worker_idle_s=out.idle_tracker.idle_s,
                worker_busy_s=out.idle_tracker.busy_s,
                num_used_tokens=used_tokens,
                num_queued_tokens=s.intake.num_queued_tokens(),  # waiting or compiling
                num_backlog_reqs=s.intake.num_queued() - s.kv.free_rows(),
            )
        )


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    ready: Connection,
    parent_pid: int,
    tp_spec: TPSpec | None = None,
) -> None:
    """One scheduler rank (`tp_spec` None: tp=1). The group forms before the model loads,
    which agrees on the KV pool size over it."""
    rank = 0 if tp_spec is None else tp_spec.rank
    become_child(
        "scheduler" if rank == 0 else f"scheduler rank {rank}", server_args.log_level, parent_pid
    )
    try:
        tp = TPGroup.single() if tp_spec is None else init_tp_group(tp_spec)
        server = SchedulerServer(server_args, port_args, tp)
    except TPInitError as e:
        logger.error("%s", e)
        ready.send(("error", str(e)))
        ready.close()
        sys.exit(1)
    except BaseException as e:
        ready.send(("error", traceback.format_exc()))
        exit_if_peer_lost(e, rank)
        raise
    ready.send(("ready", server.ready_message()))
    ready.close()
    logger.info(
        "Scheduler%s ready (pid %d, watchdog %.0f s).",
        f" rank {rank}" if tp.size > 1 else "",
        os.getpid(),
        server_args.watchdog_timeout,
    )
    try:
        server.event_loop(parent_pid)
    except BaseException as e:
        exit_if_peer_lost(e, rank)  # else the traceback and exit code 1, as any crash
        raise


def _drop_outputs(_: BatchTokenIDOut) -> None:
    """The output sink of ranks > 0: rank 0 sends the (identical) outputs."""
