"""Start the scheduler ranks and the detokenizer, wait for readiness, watch them, stop them.

Starting and waiting are two calls, so the owner can do its own loading (the tokenizer)
while the children load the model.

With `--tp-size N` over `--nnodes M`, each node starts its N/M scheduler ranks (global ranks
`node_rank * N/M ..`), each with its own `TPSpec` and ready pipe. Rank 0 keeps the name
"scheduler" (it alone talks to the tokenizer manager); the others are "scheduler rank 1",
and so on. Only node 0 runs the detokenizer. At tp=1 there is one rank and no spec: the
scheduler process runs exactly as it did before tensor parallelism.

Children are started with the `spawn` method (a fresh interpreter: no forked torch or
asyncio state) and as daemons. A watcher thread waits on their sentinels: a child that dies
while the server is not stopping is logged by name, with why when it exited on purpose (the
scheduler's step watchdog, see `managers.scheduler_process`; a rank that lost a TP peer) or
was killed by `kill`, takes the others down, and the owner is told through a callback.
When ranks die together, the watcher names the root cause: the rank that did not merely
lose a peer. Children also die with the parent (see `srt.utils.process.become_child`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from managers.detokenizer_manager import run_detokenizer_process
from managers.io_struct import SchedulerReady
from srt.distributed.spec import TPSpec, node_specs
from srt.server_args import ServerArgs
from srt.utils.process import TP_PEER_LOST_EXIT_CODE, PortArgs, describe_exit

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 5.0
# A rank that loses a peer exits (code 71) moments after the peer died; wait this long for
# the peer's own exit, so the log names the rank that actually failed.
ROOT_CAUSE_WAIT_S = 0.3


class ChildStartError(RuntimeError):
    pass


def run_scheduler(*args: Any) -> None:
    """A scheduler rank's entry point, by this module's name: the spawned child imports the
    scheduler (torch, the model code) itself, and the parent, which only needs this name to
    start it, never does."""
    from managers.scheduler_process import run_scheduler_process

    run_scheduler_process(*args)


def scheduler_name(rank: int) -> str:
    """A scheduler rank's name in logs and `procs` ("scheduler" for rank 0, as at tp=1)."""
    return "scheduler" if rank == 0 else f"scheduler rank {rank}"


def rank_specs(server_args: ServerArgs, ipc_dir: str) -> list[TPSpec | None]:
    """This node's scheduler ranks: one `None` at tp=1 (no group at all), else their specs.
    A one-node group without --dist-init-addr meets through a file in the server's private
    `ipc_dir`, not a TCP port: a port found free now may be taken by another program's
    connection before rank 0 binds it, seconds later."""
    if server_args.tp_size == 1:
        return [None]
    return node_specs(
        server_args.tp_size,
        server_args.nnodes,
        server_args.node_rank,
        server_args.dist_init_addr or f"file://{ipc_dir}/tp-group",
        server_args.resolved_device(),
        server_args.dist_timeout,
        server_args.watchdog_timeout,
    )


class ChildProcesses:
    """Started by the constructor; `wait_ready()` returns scheduler rank 0's `SchedulerReady`
    (on a node > 0, the first local rank's)."""

    def __init__(self, server_args: ServerArgs) -> None:
        from srt.model_loader.sources import resolve_model_path

        # Resolve (and convert a GGUF) once here, so the children load the same folder.
        model_path = resolve_model_path(server_args.model_path, server_args.cache_dir)
        self.model_path = model_path
        child_args = dataclasses.replace(server_args, model_path=model_path)
        self.port_args = PortArgs.new()
        self.stopping = False
        self.kill_reasons: dict[str, str] = {}  # why `kill` ended a child, by name
        ctx = mp.get_context("spawn")
        pid = os.getpid()
        self.procs: dict[str, Any] = {}
        self._readers: dict[str, Connection] = {}  # scheduler name -> its ready pipe
        writers = []
        for spec in rank_specs(server_args, self.port_args.ipc_dir):
            name = scheduler_name(spec.rank if spec is not None else 0)
            reader, writer = ctx.Pipe(duplex=False)
            # At tp=1 the call is the one from before tensor parallelism, argument for argument.
            args = (child_args, self.port_args, writer, pid) + ((spec,) if spec else ())
            self.procs[name] = ctx.Process(
                target=run_scheduler,
                args=args,
                name="radixrt-" + name.replace(" ", "-"),
                daemon=True,
            )
            self._readers[name] = reader
            writers.append(writer)
        if server_args.node_rank == 0:
            self.procs["detokenizer"] = ctx.Process(
                target=run_detokenizer_process,
                args=(child_args, self.port_args, model_path, pid),
                name="radixrt-detokenizer",
                daemon=True,
            )
        for proc in self.procs.values():
            proc.start()
        for writer in writers:
            writer.close()

    def wait_ready(self) -> SchedulerReady:
        """Block until every local scheduler rank is ready; on a failed start (a rank's
        error, e.g. a group that did not form within --dist-timeout), stop every child and
        raise `ChildStartError` with that rank's text."""
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()
            raise
        finally:
            for reader in self._readers.values():
                reader.close()

    def _wait_ready(self) -> SchedulerReady:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = dict(self._readers)
        readies: dict[str, SchedulerReady] = {}
        while pending:
            watched = [*pending.values(), *(self.procs[name].sentinel for name in pending)]
            ready = wait(watched, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                names = ", ".join(pending)
                raise ChildStartError(f"Not ready after {READY_TIMEOUT_S:.0f} s: {names}")
            for name, reader in list(pending.items()):
                proc = self.procs[name]
                if reader not in ready and proc.sentinel not in ready:
                    continue
                # A rank that sent its answer and then exited readies both: read it first.
                try:
                    status, payload = reader.recv()
                except EOFError:  # it died before it could answer
                    proc.join(0.1)
                    why = describe_exit(proc.exitcode)
                    raise ChildStartError(f"{name.capitalize()} exited during startup ({why})")
                if status != "ready":
                    raise ChildStartError(f"{name.capitalize()} failed to start:\n{payload}")
                readies[name] = payload
                del pending[name]
        return readies.get("scheduler") or next(iter(readies.values()))

    def pids(self) -> dict[str, int | None]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` from a watchdog thread if a child dies unexpectedly."""

        def run() -> None:
            sentinels = {proc.sentinel: name for name, proc in self.procs.items()}
            done = wait(list(sentinels))
            if self.stopping:
                return
            name = root_cause(self.procs, [sentinels[s] for s in done])
            proc = self.procs[name]
            why = self.kill_reasons.get(name) or describe_exit(proc.exitcode)
            reason = f"{name} process (pid {proc.pid}) exited unexpectedly ({why})"
            logger.error("%s; shutting down.", reason[0].upper() + reason[1:])
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


def root_cause(procs: dict[str, Any], dead: list[str], wait_s: float = ROOT_CAUSE_WAIT_S) -> str:
    """Of the children found dead (`dead`, names in `procs`), the one to blame: not a rank
    that only lost a peer (code 71) when the peer that failed is a local child too.

    Waits up to `wait_s` for that peer only when every child found dead lost a peer, so a
    single crash (any death at tp=1) is reported at once, as before."""
    # A ready sentinel can precede the exit status by a moment (the kernel closes a dying
    # process's files before it becomes reapable): join, not `is_alive()`, reads the code.
    for name in dead:
        procs[name].join(0.1)
    found = list(dead)
    if all(procs[name].exitcode == TP_PEER_LOST_EXIT_CODE for name in found):
        deadline = time.monotonic() + wait_s
        others = {proc.sentinel: name for name, proc in procs.items() if name not in found}
        while others and (left := deadline - time.monotonic()) > 0:
            for sentinel in wait(list(others), timeout=left):
                name = others.pop(sentinel)
                procs[name].join(0.1)
                found.append(name)
    for name in found:
        if procs[name].exitcode != TP_PEER_LOST_EXIT_CODE:
            return name
    return found[0]  # the failed peer is on another node
