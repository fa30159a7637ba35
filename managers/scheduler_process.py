"""The scheduler process: receive messages over ZMQ, step the scheduler, send outputs.

    tokenizer manager ──PUSH──▶ [scheduler_input]  scheduler  ──PUSH──▶ detokenizer
                      ◀─PUSH── (stats, control replies)

The loop drains every pending message before each step, so a burst of arrivals joins one
prefill batch; when the scheduler is idle it blocks on the socket instead of spinning.
Readiness (or the startup error) goes back to the parent through a pipe.

Liveness: `SchedulerStats` goes out at least every `STATS_INTERVAL_S` while the loop turns
and every `IDLE_POLL_MS` while it is idle, and the main process reads it as a heartbeat
(`/health` fails once it stops). A `StepWatchdog` thread ends the process with
`WATCHDOG_EXIT_CODE` when one iteration (the messages it handles and its scheduler step, a
forward included) runs past `--watchdog-timeout`: it logs what was running and every
thread's stack first. The main process then fails the open requests with 503 and exits 1,
as for any dead child.
"""

from __future__ import annotations

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
    SchedulerReady,
    SchedulerStats,
)
from managers.scheduler import Scheduler
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
IDLE_POLL_MS = 1000


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
    """Owns the sockets and the loop around one `Scheduler`."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        from managers.model_worker import ModelWorker
        from srt.model_loader.loader import get_tokenizer

        self.server_args = server_args
        worker = ModelWorker(server_args)
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            tokenizer = get_tokenizer(worker.model_config.model_path, server_args.tokenizer_path)
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = zmq_socket(
            ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True
        )
        self.send_to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc, bind=False)
        self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
        self.scheduler = Scheduler(
            server_args, worker, self.send_to_detokenizer.send_pyobj, tokenizer
        )
        self.scheduler.raise_on_leak = False
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
        )

    # ---- loop ----------------------------------------------------------------------
    def event_loop(self, parent_pid: int) -> None:
        self.watchdog.start()
        while True:
            msgs = self.recv_requests()
            self.watchdog.begin()
            for msg in msgs:
                self.handle(msg)
            ran = self.scheduler.step()
            idle = self.scheduler.is_idle()
            self.maybe_send_stats(force=idle)  # going idle: report it before the idle poll
            self.watchdog.end()
            if not ran:
                if not parent_alive(parent_pid):
                    logger.error("Parent process is gone; scheduler exits.")
                    return
                if not idle:
                    time.sleep(0.001)  # requests wait for memory; do not spin

    def recv_requests(self) -> list[Any]:
        msgs: list[Any] = []
        # Nothing to run: sleep on the socket (bounded, to notice a dead parent).
        if self.scheduler.is_idle() and not self.recv_from_tokenizer.poll(IDLE_POLL_MS):
            return msgs
        while True:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def handle(self, msg: Any) -> None:
        reply = self.scheduler.handle(msg)
        if reply is not None:
            self.send_to_tokenizer.send_pyobj(reply)

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
                num_running_reqs=s.queues.num_running(),
                num_queue_reqs=len(s.queues.waiting),
                token_usage=s.kv.token_usage(),
                cache_hit_rate=out.last_cache_hit_rate,
                gen_throughput=tokens / elapsed if elapsed > 0 else 0.0,
                num_retracted_reqs=s.decode.num_retracted_reqs,
                max_total_tokens=s.kv.total_tokens,
                worker_idle_s=out.idle_tracker.idle_s,
                worker_busy_s=out.idle_tracker.busy_s,
                num_used_tokens=used_tokens,
                num_queued_tokens=s.intake.num_queued_tokens(),  # waiting or compiling
            )
        )


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, ready: Connection, parent_pid: int
) -> None:
    become_child("scheduler", server_args.log_level)
    try:
        server = SchedulerServer(server_args, port_args)
    except Exception:
        ready.send(("error", traceback.format_exc()))
        raise
    ready.send(("ready", server.ready_message()))
    ready.close()
    logger.info(
        "Scheduler ready (pid %d, watchdog %.0f s).", os.getpid(), server_args.watchdog_timeout
    )
    server.event_loop(parent_pid)
