"""Starting and stopping a `launch_server` process for the benchmarks that drive one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_radixrt(
    server_args: list[str], log: Path | None = None, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """A RadixRT server (in its own session, so `stop` reaches its children), once healthy."""
    port = port if port is not None else free_port()
    cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(port), *server_args]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if wait_healthy(proc, url, STARTUP_TIMEOUT_S):
        return proc, url
    stop(proc)
    where = f"; see {log}" if log is not None else ""
    raise SystemExit(f"the server did not start{where}")


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """Poll `url`/health until it answers 200 (True), or `proc` exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return True
        except OSError:  # not listening yet, or not healthy yet (HTTPError is an OSError)
            time.sleep(0.5)
    return False


# sglang-router's launcher imports its Python mini load balancer, which imports all of
# sglang (~8 s on a small CPU, where sglang is installed for its clients); the Rust router
# never uses it, so the launcher runs with that one module left out.
_ROUTER_LAUNCH = """
import sys, types
sys.modules["sglang_router.mini_lb"] = types.SimpleNamespace(MiniLoadBalancer=None)
from sglang_router.launch_router import main
main()
"""


def router_command(*args: str) -> list[str]:
    """The command that starts sglang-router with `args` (its `launch_router` flags)."""
    return [sys.executable, "-c", _ROUTER_LAUNCH, *args]


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the server's process group (SIGKILL after a minute); its exit status."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
