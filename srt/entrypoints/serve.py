"""`serve(server_args)`: start an `Engine`, run uvicorn until SIGINT/SIGTERM, and exit 0, or
1 if a child process failed to start or died. On a node with `--node-rank > 0`, run `worker_node` instead.

SIGTERM drains: new requests get a 503, running ones have `--shutdown-grace-period` seconds
to finish, the rest fail with a 503 (an error event on a stream), and the process exits 0.

A hung scheduler step ends the scheduler process (its own watchdog, at `--watchdog-timeout`),
which is a dead child like any other. Should the scheduler be too stuck even for that (a
call holding the GIL, a stopped process), a thread here kills it once it has sent no
heartbeat for `HEARTBEAT_KILL_GRACE_S` longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from srt.entrypoints.auth import resolve_api_key
from srt.entrypoints.http_server import create_app
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# A child died: give open connections this long to see their errors, then exit regardless.
DEATH_EXIT_DEADLINE_S = 8.0
# The scheduler's own watchdog fires at --watchdog-timeout; this process steps in this much
# later only if it did not.
HEARTBEAT_KILL_GRACE_S = 5.0
HEARTBEAT_CHECK_S = 1.0
# Seconds an idle HTTP connection stays open (see `serve`: longer than clients pool them).
KEEP_ALIVE_S = 75


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain on SIGTERM/SIGINT: the first signal runs `drain(signal name)`
    while uvicorn keeps serving (so a new request gets a JSON 503, not a refused connection),
    and uvicorn stops once it is done; a second signal cuts the drain short.

    uvicorn would also re-raise a captured signal after its shutdown, so the process would
    die *by* the signal; the server owns its exit status instead (0 after a requested stop,
    1 after a child died)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[str], Awaitable[None]]) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler interrupts the loop's thread anywhere: only hand over to the loop.
        if self.loop is None:
            self.should_exit = True
        else:
            self.loop.call_soon_threadsafe(self.on_signal, sig)

    def on_signal(self, sig: int) -> None:
        if self.drain_task is None:
            self.drain_task = asyncio.ensure_future(self.drain(signal.Signals(sig).name))
            self.drain_task.add_done_callback(lambda _: setattr(self, "should_exit", True))
        elif not self.drain_task.done():
            logger.info("Second %s: failing the running requests now.", signal.Signals(sig).name)
            self.drain_task.cancel()
        else:
            self.force_exit = True  # uvicorn stops waiting for open connections

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(server_args: ServerArgs) -> int:
    """Run the server until SIGINT/SIGTERM (exit 0) or until a child dies (exit 1). A node
    with `--node-rank > 0` serves no HTTP: it runs its scheduler ranks (`worker_node`)."""
    if server_args.node_rank > 0:
        from srt.entrypoints.worker_node import serve_worker_node

        return serve_worker_node(server_args)
    from srt.entrypoints.engine import Engine
    from srt.entrypoints.subprocesses import ChildStartError

    resolve_api_key(server_args)  # a bad key file fails before the model loads

    try:
        engine = Engine(server_args)
    except ChildStartError as e:  # its text is the child's own report (a traceback, or why)
        logger.error("%s", e)
        return 1
    app = create_app(engine.tokenizer_manager, engine.server_args)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level,
        # Longer than the idle time clients keep pooled connections (aiohttp 15 s, httpx 5 s):
        # a server that closes first races the client's next request on that connection,
        # which then fails with a reset (a POST is not retried).
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=3,
        access_log=server_args.log_level == "debug",
    )
    tm = engine.tokenizer_manager

    def drain(signal_name: str) -> Awaitable[None]:
        return tm.drain(server_args.shutdown_grace_period, f"it received {signal_name}")

    server = DrainingServer(config, drain)
    child_died = threading.Event()

    def on_child_death(reason: str) -> None:
        child_died.set()
        # Ask uvicorn to stop (open requests were already failed with 503), and make sure
        # the process ends even if a connection hangs on.
        server.should_exit = True
        timer = threading.Timer(DEATH_EXIT_DEADLINE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    engine.on_child_death = on_child_death
    watch_scheduler_heartbeat(engine, server_args.watchdog_timeout)
    logger.info("Serving %s at %s", engine.tokenizer_manager.served_model_name, server_args.url())
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if child_died.is_set() else 0


def watch_scheduler_heartbeat(engine: Any, watchdog_timeout: float) -> None:
    """Kill the scheduler from a thread once it has been silent for `watchdog_timeout +
    HEARTBEAT_KILL_GRACE_S` seconds; the child watcher then shuts the server down."""
    tm = engine.tokenizer_manager
    limit = watchdog_timeout + HEARTBEAT_KILL_GRACE_S

    def run() -> None:
        while not engine.children.stopping:
            time.sleep(HEARTBEAT_CHECK_S)
            silent = tm.scheduler_silent_s()
            if silent > limit and not engine.children.stopping:
                reason = (
                    f"killed by the main process: no heartbeat for {silent:.0f} s, "
                    f"--watchdog-timeout is {watchdog_timeout:g} s"
                )
                logger.error("The scheduler is hung (%s).", reason)
                engine.children.kill("scheduler", reason)
                return

    threading.Thread(target=run, name="radixrt-heartbeat-watch", daemon=True).start()
