"""Process plumbing shared by the three server roles: IPC endpoints, ZMQ sockets, logging,
and making sure no child outlives the server.

IPC socket files live in a private directory per server, `$TMPDIR/radixrt-<pid>-<random>`
(mode 0700, `<pid>` the main process): only its owner can connect to the sockets, which
carry pickled messages. A normal stop removes the directory; after a `kill -9` it stays
behind, and the next start on the machine removes every such directory whose pid is dead.
Linux abstract sockets (`ipc://@name`) would vanish by themselves, but anyone in the network
namespace may connect to one, whatever their user: no file permissions guard them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
from dataclasses import dataclass

import zmq

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# A child that ends itself on purpose exits with one of these codes, so the parent can say why.
WATCHDOG_EXIT_CODE = 70  # sysexits' EX_SOFTWARE: the scheduler's step watchdog fired
TP_PEER_LOST_EXIT_CODE = 71  # sysexits' EX_OSERR: a tensor-parallel collective failed
_EXIT_REASONS = {
    WATCHDOG_EXIT_CODE: "its watchdog found a scheduler step running past --watchdog-timeout",
    TP_PEER_LOST_EXIT_CODE: "a tensor-parallel peer rank was lost",
}
IPC_DIR_PREFIX = "radixrt-"
_IPC_DIR_NAME = re.compile(rf"{IPC_DIR_PREFIX}(\d+)-\w+")


@dataclass(frozen=True)
class PortArgs:
    """ZMQ IPC endpoints; each is bound by its receiver, connected to by its senders."""

    tokenizer_ipc: str  # detokenizer and scheduler -> tokenizer manager
    scheduler_input_ipc: str  # tokenizer manager -> scheduler
    detokenizer_ipc: str  # scheduler -> detokenizer
    ipc_dir: str  # private to this server: the three socket files, a one-node TP group's store

    @classmethod
    def new(cls, root: str | None = None) -> PortArgs:
        """Fresh endpoints in a new private directory under `root` (the temp dir), after
        removing the directories that dead servers left there."""
        root = root or tempfile.gettempdir()
        remove_stale_ipc_dirs(root)
        # mkdtemp creates the directory 0700; the pid in its name tells who owns it.
        ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-", dir=root)
        return cls(
            f"ipc://{ipc_dir}/tokenizer",
            f"ipc://{ipc_dir}/scheduler",
            f"ipc://{ipc_dir}/detokenizer",
            ipc_dir,
        )

    def paths(self) -> list[str]:
        endpoints = (self.tokenizer_ipc, self.scheduler_input_ipc, self.detokenizer_ipc)
        return [e.removeprefix("ipc://") for e in endpoints]

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def remove_stale_ipc_dirs(root: str) -> list[str]:
    """Remove this user's `radixrt-<pid>-*` directories in `root` whose process is dead;
    return their paths."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _IPC_DIR_NAME.fullmatch(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        logger.info("Removed the IPC directory of a dead server: %s", entry.path)
        removed.append(entry.path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


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


def become_child(role: str, log_level: str, parent_pid: int) -> None:
    """Called first in every child: die with the parent, leave SIGINT/SIGTERM to the parent.

    A terminal's Ctrl-C, `timeout`, or systemd's stop reach the whole process group; the
    parent owns shutdown (it finishes open requests, then SIGKILLs the children, which hold
    no state worth flushing), so children ignore both signals. If the parent is killed
    outright (`kill -9`), the kernel sends SIGKILL to the child (Linux), so no child is
    orphaned. A parent that died before this call (a spawned child spends seconds importing
    first) sent no such signal: the child sees it has been re-parented and exits at once.
    """
    configure_logging(log_level, role)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.debug("prctl unavailable; relying on the parent-pid check")
    if not parent_alive(parent_pid):
        logger.error("Parent process %d exited while the %s started; exiting.", parent_pid, role)
        os._exit(1)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def describe_exit(code: int | None) -> str:
    """`code N` of a child's exit status, with what it means when the child chose it (a
    negative code is the signal that killed it)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    reason = _EXIT_REASONS.get(code) if code is not None else None
    return f"code {code}: {reason}" if reason else f"code {code}"
