"""Where grammars compile: threads of the scheduler's process, or worker processes that can
be killed.

A compile cannot be interrupted (xgrammar's compiler is native code with no cancellation),
so on a thread a grammar that compiles for minutes holds that thread until it ends, whether
or not a request still waits for it. In a worker process it is stopped the moment no request
waits any more (the requests timed out or left): its worker is killed and replaced, and the
memory the compile had taken goes with it.

Lifecycle of a compile in `ProcessLanes`:

    submit ──▶ pending in its lane ──▶ running in one of the lane's workers
                  │ cancel(): dropped        │ done: the result is sent back (serialized by
                  │                          │   the worker, rebuilt here) or the compiler's
                  │                          │   error; a big result is compiled again here
                  │                          │ small lane past its budget: the worker is killed
                  │                          │   and the compile queued on the general lane
                  │                          │ cancel() while running: the worker is killed and
                  │                          │   the future fails with `CompileStopped`
                  │                          │ the worker died (killed from outside, out of
                  │                          │   memory): the future fails with `CompileCrashed`
    each killed or dead worker is started again when its lane next has a compile for it.

A compiled grammar comes back serialized only when it is small: the token-mask cache of a
big schema takes several times longer to write out and read back than to compile (figures
in docs/benchmarks.md, "Grammar compiles in processes"), so for a big one the worker's
answer is only that the compile ends, and the lane's thread compiles it again here, in
about the time the worker took.

Workers fork from a zygote process that has imported the compiler once, so that a new
worker starts in milliseconds instead of importing it again (seconds); the zygote and the
first worker start on the first compile. Workers end with the zygote (`PR_SET_PDEATHSIG`)
and the zygote with this process, so no compile outlives the server.

Two lanes, as with threads: with two or more workers, one takes only small grammars, so a
flood of big ones does not hold up a short regex or a small tool schema. Size does not
always tell (a 100-byte schema can compile for minutes), so a compile on the small lane
that runs past `SMALL_BUDGET_S` is stopped and started again on the general lane.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# How often a dispatcher waiting on its worker looks for a cancellation: the longest a
# stopped compile keeps its worker busy.
POLL_S = 0.05
_PR_SET_PDEATHSIG = 1
# What a small grammar (a tool schema, a short regex) usually takes is milliseconds; one
# still compiling after this long is moved off the small lane.
SMALL_BUDGET_S = 1.0


class CompileStopped(RuntimeError):
    """No request waits for this compile any more, so its worker was killed."""


class CompileCrashed(RuntimeError):
    """The worker compiling this grammar died before it answered."""


class _OverBudget(Exception):
    """A compile on the small lane ran past its budget."""


STOPPED = "stopped: no request waits for this grammar any more"


def _stop(future: CompileFuture) -> None:
    """End a compile that has not run here: cancelled if pending, failed if it was moved
    here while running."""
    if not future.cancel() and not future.done():
        future.set_exception(CompileStopped(STOPPED))


class CompileFuture(Future):
    """A compile's future. `cancel()` on one that already runs returns False, as any
    future's does, and asks its lane to stop it (`stopping`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = threading.Event()

    def cancel(self) -> bool:
        if super().cancel():
            return True
        if not self.done():
            self.stopping.set()
        return False


def abandoned(future: Future[Any]) -> bool:
    """Cancelled, or asked to stop: a cache must not hand it to a new request."""
    return future.cancelled() or (isinstance(future, CompileFuture) and future.stopping.is_set())


class CompileLanes(Protocol):
    def submit(self, key: Any, small: bool) -> Future[Any]: ...

    def shutdown(self) -> None: ...


class ThreadLanes:
    """Compiles on threads of this process (`--grammar-compile-isolation thread`)."""

    def __init__(self, compile: Callable[[Any], Any], workers: int) -> None:
        self.compile = compile
        self.big = ThreadPoolExecutor(max(1, workers - 1), thread_name_prefix="grammar-compile")
        self.small = self.big
        if workers > 1:
            self.small = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile-small")

    def submit(self, key: Any, small: bool) -> Future[Any]:
        return (self.small if small else self.big).submit(self.compile, key)

    def shutdown(self) -> None:
        """Queued compiles are dropped; running ones finish in the background."""
        for executor in {self.big, self.small}:
            executor.shutdown(wait=False, cancel_futures=True)


class ProcessLanes:
    """Compiles in worker processes (`--grammar-compile-isolation process`, the default).

    `worker_main` ("module:function") runs in each worker as `function(conn, init())`: it
    answers every key it receives with `("ok", payload)`, `("error", message)` or
    `("compile here", None)`; `decode(payload)` rebuilds the result here, a message becomes
    `error_type(message)`, and "compile here" (a result too big to ship: the worker has
    shown that the compile ends) runs `compile_here(key)` on this lane's thread. `init` is
    called when the first worker starts. The process's zygote imports `worker_main`'s
    module once. A compile on the small lane that runs past `small_budget_s` was misjudged
    as small (a short schema can still take minutes): it is stopped and started again on
    the general lane, so that the small lane stays quick."""

    def __init__(
        self,
        worker_main: str,
        init: Callable[[], Any],
        decode: Callable[[Any], Any],
        error_type: Callable[[str], Exception],
        workers: int,
        small_budget_s: float = SMALL_BUDGET_S,
        compile_here: Callable[[Any], Any] | None = None,
    ) -> None:
        self.worker_main = worker_main
        self.compile_here = compile_here
        self.small_budget_s = small_budget_s
        self.make_init = init
        self.decode = decode
        self.error_type = error_type
        self.init: Any = None
        self.closing = threading.Event()
        self.big: queue.SimpleQueue[tuple[CompileFuture, Any] | None] = queue.SimpleQueue()
        self.small = self.big
        if workers > 1:
            self.small = queue.SimpleQueue()
        lanes = [self.big] * max(1, workers - 1) + ([self.small] if workers > 1 else [])
        self.workers = [_Worker(self, lane, i) for i, lane in enumerate(lanes)]
        for worker in self.workers:
            worker.thread.start()

    def submit(self, key: Any, small: bool) -> Future[Any]:
        future = CompileFuture()
        if self.closing.is_set():
            future.cancel()
        else:
            (self.small if small else self.big).put((future, key))
        return future

    def fork_worker(self) -> tuple[int, Connection]:
        if self.init is None:  # two workers starting at once both make it: harmless
            self.init = self.make_init()
        return _zygote().fork(self.worker_main, self.init)

    def pids(self) -> list[int]:
        """The worker processes running now."""
        return [w.pid for w in self.workers if w.pid is not None]

    def shutdown(self) -> None:
        """Pending compiles are dropped and running ones stopped; the workers end."""
        self.closing.set()
        for worker in self.workers:
            worker.lane.put(None)
        for worker in self.workers:
            worker.thread.join(timeout=5)


class _Worker:
    """One worker process (started when needed) and the thread here that feeds it."""

    def __init__(self, lanes: ProcessLanes, lane: queue.SimpleQueue, index: int) -> None:
        self.lanes = lanes
        self.lane = lane
        # The small lane's compiles must be quick: one that is not is moved to the others.
        self.budget_s = (
            lanes.small_budget_s if lane is lanes.small and lanes.small is not lanes.big else None
        )
        self.pid: int | None = None
        self.conn: Connection | None = None
        self.thread = threading.Thread(target=self.serve, name=f"grammar-worker-{index}")
        self.thread.daemon = True

    def serve(self) -> None:
        while (job := self.lane.get()) is not None:
            future, key = job
            if self.lanes.closing.is_set() or future.stopping.is_set():
                _stop(future)
            elif future.running() or future.set_running_or_notify_cancel():
                self.run(future, key)  # a running one was moved here from the small lane
        self.kill()

    def run(self, future: CompileFuture, key: Any) -> None:
        try:
            status, payload = self.ask(future, key)
            if status == "error":
                raise self.lanes.error_type(payload)
            if status == "compile here":
                assert self.lanes.compile_here is not None
                future.set_result(self.lanes.compile_here(key))
            else:
                future.set_result(self.lanes.decode(payload))
        except _OverBudget:
            self.lanes.big.put((future, key))
        except CompileStopped as e:
            future.set_exception(e)
        except (OSError, EOFError) as e:  # the worker died, or its pipe broke
            logger.warning("grammar compile worker %s died: %s", self.pid, e)
            self.kill()
            future.set_exception(CompileCrashed("the compiling process ended before it answered"))
        except Exception as e:  # noqa: BLE001 - every failure goes to its request
            future.set_exception(e)

    def ask(self, future: CompileFuture, key: Any) -> tuple[str, Any]:
        if self.conn is None:
            self.pid, self.conn = self.lanes.fork_worker()
        self.conn.send(key)
        started = time.monotonic()
        # A dead worker's pipe reads as ready too: `recv` then raises EOFError.
        while not self.conn.poll(POLL_S):
            if future.stopping.is_set() or self.lanes.closing.is_set():
                logger.info(
                    "grammar compile stopped after %.1f s: no request waits for it "
                    "(worker %d killed)",
                    time.monotonic() - started,
                    self.pid,
                )
                self.kill()
                raise CompileStopped(STOPPED)
            if self.budget_s is not None and time.monotonic() - started > self.budget_s:
                logger.info(
                    "grammar judged small still compiling after %.1f s: moved to the "
                    "general workers (worker %d killed)",
                    self.budget_s,
                    self.pid,
                )
                self.kill()
                raise _OverBudget
        return self.conn.recv()

    def kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it died on its own
                os.kill(self.pid, signal.SIGKILL)
        if self.conn is not None:
            self.conn.close()
        self.pid = self.conn = None


class _Zygote:
    """A process that forks compile workers on request, so that a worker starts in
    milliseconds: the zygote imports a worker's module once (seconds, for xgrammar and the
    torch it imports), at its first request for it, and every later worker inherits it. One
    per process, shared by every backend (a test process has many). Not multiprocessing's
    fork server: that re-imports the parent's main module in every child.

    Its workers are its children: it reaps them (SIGCHLD ignored) and they die with it
    (`PR_SET_PDEATHSIG`). It ends when this process does: its socket then reads end of file."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = f"from constrained.compile_pool import zygote_main; zygote_main({theirs.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()

    def fork(self, worker_main: str, init: Any) -> tuple[int, Connection]:
        """A new worker running `worker_main` ("module:function") as `function(conn, init)`:
        its pid and this side's end of its pipe."""
        ours, theirs = socket.socketpair()
        with self.lock, theirs:
            send_handle(self.conn, theirs.fileno(), self.proc.pid)
            self.conn.send((worker_main, init))
            pid = self.conn.recv()
        return pid, Connection(ours.detach())


_ZYGOTE: list[_Zygote] = []
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
            _ZYGOTE[:] = [_Zygote()]
        return _ZYGOTE[0]


def zygote_main(fd: int) -> None:
    conn = Connection(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    while True:
        try:
            worker_fd = recv_handle(conn)
            worker_main, init = conn.recv()
        except EOFError:  # the scheduler ended: end, and the workers with us
            return
        module, name = worker_main.split(":")
        target = getattr(importlib.import_module(module), name)
        pid = os.fork()
        if pid == 0:
            conn.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _die_with_parent()
            try:
                target(Connection(worker_fd), init)
            finally:
                os._exit(0)
        os.close(worker_fd)
        conn.send(pid)


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent does: a worker stuck in a compile
    would otherwise outlive the server."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the server's own shutdown ends them
        return
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
