"""The tests' port picker: each xdist worker its own ports, none the kernel hands out."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.ports import LOWEST, _Ports, worker_slice


def test_worker_slices_are_disjoint_and_below_the_ephemeral_range():
    slices = [worker_slice(f"gw{i}", 2, 32768) for i in range(2)]
    assert not set(slices[0]) & set(slices[1])
    for ports in slices:
        assert ports.start >= LOWEST and ports.stop <= 32768 and len(ports) > 1000
    assert worker_slice(None, 1, 32768) == range(LOWEST, 32768)


def test_a_port_in_use_is_skipped_and_none_is_handed_out_twice():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    held = holder.getsockname()[1]
    try:
        ports = _Ports(range(held, held + 50))
        ports.next = 0
        taken = [ports.take(), ports.take()]
        assert held not in taken and len(set(taken)) == 2
    finally:
        holder.close()


def test_two_workers_pick_different_ports():
    code = (
        "import json; from tests.ports import free_port; "
        "print(json.dumps([free_port() for _ in range(50)]))"
    )
    picked = []
    for worker in ("gw0", "gw1"):
        env = {"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": "2", "PATH": ""}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=Path(__file__).parents[1],
            capture_output=True,
            text=True,
            check=True,
        )
        picked.append(set(json.loads(out.stdout)))
    assert len(picked[0]) == len(picked[1]) == 50
    assert not picked[0] & picked[1]
