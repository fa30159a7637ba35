"""A real `launch_server` subprocess on a free port, for the HTTP tests."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.ports import free_port

STARTUP_TIMEOUT_S = 180.0


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (no stray servers)."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


class ServerProcess:
    def __init__(
        self, *args: str, log_path: Path | None = None, port: int | None = None, wait: bool = True
    ) -> None:
        """Start `launch_server` with `args`; unless `wait` is False (then call `wait_ready`),
        return once it is healthy."""
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(self.port), *args]
        self.log_path = log_path
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl
        )
        self.children: list[int] = []
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    self.children = child_pids(self.proc.pid)
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        if self.log_path is None:
            return ""
        return self.log_path.read_text()[-n:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            for pid in self.children:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise
        finally:
            if self.log is not subprocess.DEVNULL:
                self.log.close()
