"""Start the scheduler and detokenizer processes, wait for readiness, watch them, stop them.

Starting and waiting are two calls, so the owner can do its own loading (the tokenizer)
while the children load the model.

Children are started with the `spawn` method (a fresh interpreter: no forked torch or
asyncio state) and as daemons. A watcher thread waits on their sentinels: a child that dies
while the server is not stopping is logged by name, with why when it exited on purpose (the
scheduler's step watchdog, see `managers.scheduler_process`) or was killed by `kill`, takes
the others down, and the owner is told through a callback. Children also die with the
parent (see `srt.utils.process.become_child`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

from managers.detokenizer_manager import run_detokenizer_process
from managers.io_struct import SchedulerReady
from managers.scheduler_process import run_scheduler_process
from srt.server_args import ServerArgs
from srt.utils.process import PortArgs, describe_exit

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 5.0


class ChildStartError(RuntimeError):
    pass


class ChildProcesses:
    """Started by the constructor; `wait_ready()` returns the scheduler's `SchedulerReady`."""

    def __init__(self, server_args: ServerArgs) -> None:
        from srt.model_loader.loader import resolve_model_path

        # Resolve (and convert a GGUF) once here, so the children load the same folder.
        model_path = resolve_model_path(server_args.model_path, server_args.cache_dir)
        self.model_path = model_path
        child_args = dataclasses.replace(server_args, model_path=model_path)
        self.port_args = PortArgs.new()
        self.stopping = False
        self.kill_reasons: dict[str, str] = {}  # why `kill` ended a child, by role
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        pid = os.getpid()
        self.procs = {
            "scheduler": ctx.Process(
                target=run_scheduler_process,
                args=(child_args, self.port_args, writer, pid),
                name="radixrt-scheduler",
                daemon=True,
            ),
            "detokenizer": ctx.Process(
                target=run_detokenizer_process,
                args=(child_args, self.port_args, model_path, pid),
                name="radixrt-detokenizer",
                daemon=True,
            ),
        }
        for proc in self.procs.values():
            proc.start()
        writer.close()
        self._reader = reader

    def wait_ready(self) -> SchedulerReady:
        """Block until the scheduler is ready; on a failed start, stop every child and raise
        `ChildStartError`."""
        try:
            return self._wait_ready(self._reader)
        except BaseException:
            self.stop()
            raise
        finally:
            self._reader.close()

    def _wait_ready(self, reader: mp.connection.Connection) -> SchedulerReady:
        scheduler = self.procs["scheduler"]
        ready = wait([reader, scheduler.sentinel], timeout=READY_TIMEOUT_S)
        if reader in ready:
            try:
                status, payload = reader.recv()
            except EOFError:
                status, payload = "error", "the scheduler exited during startup"
            if status == "ready":
                return payload
            raise ChildStartError(f"Scheduler failed to start:\n{payload}")
        if not ready:
            raise ChildStartError(f"Scheduler not ready after {READY_TIMEOUT_S:.0f} s")
        raise ChildStartError(f"Scheduler exited during startup (code {scheduler.exitcode})")

    def pids(self) -> dict[str, int | None]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` from a watchdog thread if a child dies unexpectedly."""

        def run() -> None:
            sentinels = {proc.sentinel: name for name, proc in self.procs.items()}
            done = wait(list(sentinels))
            if self.stopping:
                return
            name = sentinels[done[0]]
            proc = self.procs[name]
            proc.join(0.1)
            why = self.kill_reasons.get(name) or describe_exit(proc.exitcode)
            reason = f"{name} process (pid {proc.pid}) exited unexpectedly ({why})"
            logger.error("%s; shutting down.", reason.capitalize())
            self.stop()
            on_death(reason)

        threading.Thread(target=run, name="radixrt-child-watcher", daemon=True).start()

    def kill(self, name: str, reason: str) -> None:
        """Kill one child on purpose; the watcher reports its death with `reason`."""
        self.kill_reasons[name] = reason
        self.procs[name].kill()

    def stop(self) -> None:
        """Kill every child and reap it. Children ignore SIGTERM (see `become_child`); they
        hold nothing that needs flushing, so SIGKILL is the whole protocol."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(STOP_TIMEOUT_S)
        self.port_args.cleanup()
