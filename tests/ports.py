"""TCP ports for the servers and sockets the tests start.

A port found free by binding port 0 is free only until the probe closes: the kernel may hand
it to anyone's next outgoing connection or bound socket, and the test binds it later, in
another process. With two pytest workers the other worker's clients and servers take
ephemeral ports all the time, and a test's bootstrap port once came back "already in use".
So the tests take their ports from below the kernel's ephemeral range, where nothing is given
out unasked, and each xdist worker from a slice of its own, so two workers never pick the same
one. A port is still bound once before it is handed out (another program may hold it)."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# Below the usual ephemeral start (32768) and above the ports Mooncake's transfer engine
# picks for its handshakes (12300-14300).
LOWEST = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def worker_slice(worker: str | None, workers: int, top: int) -> range:
    """The ports of `worker` ("gw0", "gw1", ... or None outside xdist) among `workers`."""
    index = int(worker[2:]) if worker and worker.startswith("gw") else 0
    workers = max(workers, index + 1)
    size = (top - LOWEST) // workers
    start = LOWEST + index * size
    return range(start, start + size)


def _this_worker() -> range:
    return worker_slice(
        os.environ.get("PYTEST_XDIST_WORKER"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
        _ephemeral_start(),
    )


class _Ports:
    """Hands out this worker's ports in turn from a random start, never one twice."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self.next = random.randrange(len(ports))
        self.handed_out: set[int] = set()

    def take(self) -> int:
        for _ in range(len(self.ports)):
            port = self.ports[self.next]
            self.next = (self.next + 1) % len(self.ports)
            if port not in self.handed_out and _bindable(port):
                self.handed_out.add(port)
                return port
        raise RuntimeError(f"no free port left in {self.ports}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_ports: _Ports | None = None


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, that no other test worker will pick, and that
    the kernel does not give out to connections on its own."""
    global _ports
    if _ports is None:
        ports = _this_worker()
        if len(ports) < 100:  # an unusual ephemeral range: fall back to the kernel's pick
            return _kernel_pick()
        _ports = _Ports(ports)
    return _ports.take()


def _kernel_pick() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
