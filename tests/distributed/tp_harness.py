"""`TPRanks`: N persistent spawned processes joined in one tensor-parallel group, to run test
functions on every rank at once.

`run(fn, *args)` sends a top-level (importable) function to every rank, each calls
`fn(tp, *args)` with its `TPGroup`, and the results come back as a list in rank order. An
exception on any rank fails the call with that rank's traceback. The ranks start once (a few
seconds of imports) and serve many tests; each takes one torch thread, so two ranks fit the
2-core CI machine. `kill(rank)` is for fault tests (the group is broken afterwards).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from srt.distributed import TPSpec, init_tp_group

RANK_TIMEOUT_S = 600.0


def _rank_main(spec: TPSpec, conn: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    tp = init_tp_group(spec)
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            conn.send(("ok", fn(tp, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            conn.send(("error", traceback.format_exc()))
    tp.destroy()


class TPRanks:
    def __init__(self, size: int = 2, backend: str = "gloo", op_timeout_s: float = 120.0) -> None:
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix="radixrt-tp-")
        store = f"file://{os.path.join(self._dir.name, 'store')}"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(size):
            spec = TPSpec(rank, size, rank, size, store, backend, 60.0, op_timeout_s)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(spec, theirs), daemon=True)
            proc.start()
            self._conns.append(ours)
            self.procs.append(proc)
        for rank in range(size):
            self._recv(rank)

    def _reply(self, rank: int) -> tuple[str, Any]:
        conn = self._conns[rank]
        if not conn.poll(RANK_TIMEOUT_S):
            raise TimeoutError(f"TP rank {rank} did not answer within {RANK_TIMEOUT_S:g} s")
        return conn.recv()

    def _recv(self, rank: int) -> Any:
        status, value = self._reply(rank)
        if status == "error":
            raise RuntimeError(f"TP rank {rank} failed:\n{value}")
        return value

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank's result; when some rank fails, every reply is still read first (so the
        ranks stay usable for the next test) and the first failure is raised."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = [self._reply(rank) for rank in range(self.size)]
        for rank, (status, value) in enumerate(replies):
            if status == "error":
                raise RuntimeError(f"TP rank {rank} failed:\n{value}")
        return [value for _, value in replies]

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def close(self) -> None:
        for proc, conn in zip(self.procs, self._conns, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._dir.cleanup()
