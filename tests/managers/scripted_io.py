"""Test doubles of a scheduler's inputs: its PULL socket and its wall clock, both scripted."""

from __future__ import annotations

from typing import Any

import zmq


class ScriptedSocket:
    """Test double of the scheduler's PULL socket: what the script pushed, nothing more."""

    def __init__(self) -> None:
        self.queue: list[Any] = []

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.queue)

    def recv_pyobj(self, flags: int = 0) -> Any:
        if not self.queue:
            raise zmq.Again()
        return self.queue.pop(0)


class ScriptedTime:
    """A wall clock that moves only when the test sets `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
