"""The server's main process (HTTP, tokenizer manager) and its detokenizer never run a model,
so they never load torch: each would spend seconds of a start importing it. Checked on the
live shared server by the libraries mapped into each process."""

from __future__ import annotations

from pathlib import Path

import requests

from tests.server.server_process import ServerProcess


def maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_scheduler_loads_torch(server: ServerProcess) -> None:
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    schedulers = {state["pid"] for state in info["internal_states"]}  # every rank's
    assert schedulers <= set(server.children)
    assert all(maps_torch(pid) for pid in schedulers)
    assert not maps_torch(server.proc.pid), "the main process loaded torch"
    others = [pid for pid in server.children if pid not in schedulers]
    detokenizer = [
        pid for pid in others if "multiprocessing-fork" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    assert len(detokenizer) == 1, others
    assert not maps_torch(detokenizer[0]), "the detokenizer loaded torch"
