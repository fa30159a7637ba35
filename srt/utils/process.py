"""Process plumbing shared by the three server roles: IPC endpoints, ZMQ sockets, logging,
and making sure no child outlives the server."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import tempfile
import uuid
from dataclasses import dataclass

import zmq

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PortArgs:
    """ZMQ IPC endpoints; each is bound by its receiver, connected to by its senders."""

    tokenizer_ipc: str  # detokenizer and scheduler -> tokenizer manager
    scheduler_input_ipc: str  # tokenizer manager -> scheduler
    detokenizer_ipc: str  # scheduler -> detokenizer

    @classmethod
    def new(cls) -> PortArgs:
        base = os.path.join(tempfile.gettempdir(), f"radixrt-{uuid.uuid4().hex[:12]}")
        return cls(f"ipc://{base}-tokenizer", f"ipc://{base}-scheduler", f"ipc://{base}-detok")

    def paths(self) -> list[str]:
        return [e.removeprefix("ipc://") for e in vars(self).values()]

    def cleanup(self) -> None:
        for path in self.paths():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def zmq_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    elif kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"[%(asctime)s {role}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def become_child(role: str, log_level: str) -> None:
    """Called first in every child: die with the parent, leave SIGINT/SIGTERM to the parent.

    A terminal's Ctrl-C, `timeout`, or systemd's stop reach the whole process group; the
    parent owns shutdown (it finishes open requests, then SIGKILLs the children, which hold
    no state worth flushing), so children ignore both signals. If the parent is killed
    outright (`kill -9`), the kernel sends SIGKILL to the child (Linux), so no child is
    orphaned.
    """
    configure_logging(log_level, role)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.debug("prctl unavailable; relying on the parent-pid check")


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
