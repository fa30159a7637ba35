"""A stand-in for a grammar compile worker (a test double for `ProcessLanes`): each key is a
command, so a test decides how long a "compile" runs and how it ends."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection


def main(conn: Connection, init: str) -> None:
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        if op == "echo":
            conn.send(("ok", f"{init}:{arg}"))
        elif op == "sleep":  # a compile that runs for `arg` seconds
            time.sleep(arg)
            conn.send(("ok", arg))
        elif op == "fail":  # an invalid grammar
            conn.send(("error", arg))
        elif op == "big":  # a result too big to send back
            conn.send(("compile here", None))
        elif op == "pid":
            conn.send(("ok", os.getpid()))
        elif op == "exit":  # the worker dies (a crash, the OOM killer)
            os._exit(arg)
