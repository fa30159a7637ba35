"""Tensor parallelism over two nodes (two `launch_server` processes on this machine, a tiny
random Llama): the pair serves what tp=1 serves; a node that never comes makes node 0 exit
non-zero after --dist-timeout; a stopped worker node exits 0 and takes node 0 down. And,
without a server: the child watcher's choice of the rank to blame (with plain processes),
and the one memory_integrity verdict over every rank."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import requests

from managers.io_struct import MemoryIntegrity, SchedulerState
from managers.server_status import combined_memory_integrity as combined
from srt.entrypoints.subprocesses import rank_specs, root_cause
from srt.server_args import ServerArgs
from srt.utils.process import TP_PEER_LOST_EXIT_CODE
from tests.ports import free_port
from tests.server.server_process import ServerProcess, alive, child_pids, die_with_parent

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [[1, 5, 9, 33, 71], [1, 200, 3], list(range(2, 40))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.engine.tiny_models import save_tiny_model

    return str(save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama")))


def node_args(model: str, addr: str, node_rank: int, *extra: str) -> list[str]:
    return [
        "--model-path", model, "--skip-tokenizer-init", "--dtype", "float32",
        "--max-total-tokens", "2048", "--tp-size", "2", "--nnodes", "2",
        "--node-rank", str(node_rank), "--dist-init-addr", addr, *extra,
    ]  # fmt: skip


def start_worker_node(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "srt.launch_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl
        )


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "orphaned child processes"


@pytest.mark.slow
def test_two_nodes_serve_what_tp1_serves_and_stop_together(tiny_llama: str, tmp_path) -> None:
    from managers.inprocess import InProcessDriver
    from srt.server_args import ServerArgs

    addr = f"127.0.0.1:{free_port()}"
    node1 = start_worker_node(node_args(tiny_llama, addr, 1), tmp_path / "node1.log")
    node0 = ServerProcess(*node_args(tiny_llama, addr, 0), log_path=tmp_path / "node0.log")
    try:
        r = requests.post(
            node0.url + "/generate",
            json={"input_ids": PROMPTS, "sampling_params": PARAMS},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        served = [out["output_ids"] for out in r.json()]
        info = requests.get(node0.url + "/get_server_info", timeout=30).json()
        states = info["internal_states"]
        assert [s["tp_rank"] for s in states] == [0, 1]
        assert states[1]["pid"] in child_pids(node1.pid)  # rank 1 runs on node 1
        assert info["memory_integrity"]["ok"] is not False, info["memory_integrity"]
        worker_children = child_pids(node1.pid)

        # A stopped worker node exits 0; node 0's rank loses its peer, and the server ends.
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        assert node0.proc.wait(30) != 0
        text = (tmp_path / "node0.log").read_text()
        assert "exited unexpectedly (code 71: a tensor-parallel peer rank was lost)" in text
        assert_gone(worker_children + node0.children)
    finally:
        node0.stop(signal.SIGKILL)
        node1.kill()
        node1.wait(30)

    driver = InProcessDriver(
        ServerArgs(
            model_path=tiny_llama,
            skip_tokenizer_init=True,
            dtype="float32",
            max_total_tokens=2048,
        )
    )
    assert served == [out["output_ids"] for out in driver.generate(PROMPTS, PARAMS)]


@pytest.mark.slow
def test_missing_node_fails_the_start_after_dist_timeout(tiny_llama: str, tmp_path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    log = tmp_path / "node0.log"
    node0 = ServerProcess(
        *node_args(tiny_llama, addr, 0, "--dist-timeout", "5"), log_path=log, wait=False
    )
    try:
        code = node0.proc.wait(120)
    finally:
        node0.stop(signal.SIGKILL)
    assert code != 0
    assert "did not form" in log.read_text(), log.read_text()[-3000:]


# ---- the watcher's choice, with plain processes -------------------------------------------


def _children(**targets: tuple[object, tuple[object, ...]]) -> dict[str, BaseProcess]:
    """Children named like the server's ("scheduler_rank_1" is "scheduler rank 1") running
    builtins (picklable for spawn, which imports nothing of ours): os._exit or time.sleep."""
    ctx = mp.get_context("spawn")
    procs = {}
    for name, (target, args) in targets.items():
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        procs[name.replace("_", " ")] = proc
    return procs


def _first_dead(procs: dict[str, BaseProcess]) -> list[str]:
    sentinels = {proc.sentinel: name for name, proc in procs.items()}
    return [sentinels[s] for s in wait(list(sentinels))]


def _reap(procs: dict[str, BaseProcess]) -> None:
    for proc in procs.values():
        proc.kill()
        proc.join()


def test_root_cause_is_the_rank_that_did_not_lose_a_peer() -> None:
    # Rank 0 notices first (code 71); rank 1, the one that failed, dies a moment later.
    # (A long wait, so a busy machine cannot make it too short; it ends when rank 1 does.)
    procs = _children(
        scheduler=(os._exit, (TP_PEER_LOST_EXIT_CODE,)), scheduler_rank_1=(time.sleep, (60,))
    )
    try:
        dead = _first_dead(procs)
        assert dead == ["scheduler"]
        threading.Timer(0.2, procs["scheduler rank 1"].kill).start()
        name = root_cause(procs, dead, wait_s=60.0)
        assert name == "scheduler rank 1", {n: p.exitcode for n, p in procs.items()}
    finally:
        _reap(procs)


def test_root_cause_without_a_local_culprit_is_the_first_dead() -> None:
    # The failed peer is on another node: only the lost-peer rank dies here.
    procs = _children(
        scheduler=(os._exit, (TP_PEER_LOST_EXIT_CODE,)), detokenizer=(time.sleep, (60,))
    )
    try:
        assert root_cause(procs, _first_dead(procs)) == "scheduler"
        assert procs["detokenizer"].is_alive()
    finally:
        _reap(procs)


def test_root_cause_of_one_crash_is_that_child() -> None:
    procs = _children(scheduler=(os._exit, (1,)), detokenizer=(time.sleep, (60,)))
    try:
        assert root_cause(procs, _first_dead(procs)) == "scheduler"
    finally:
        _reap(procs)


# ---- /get_server_info's one memory_integrity over every rank -------------------------------


def _state(
    rank: int, ok: bool | None, error: str | None = None, at: float | None = None
) -> SchedulerState:
    check = MemoryIntegrity(ok, error, at)
    return SchedulerState(
        0, 0, 0.0, 64, 4, 0, 0, True, 0.0, 0.0, 100 + rank, 0.5, 0, check, tp_rank=rank
    )


def test_memory_integrity_over_ranks() -> None:
    one = _state(0, False, "slot 3 leaked", 1.0)
    assert combined([one]) is one.memory_integrity  # tp=1: rank 0's own, as before
    assert combined([_state(0, True, at=2.0), _state(1, True, at=1.0)]) == MemoryIntegrity(
        True, None, 1.0
    )
    assert combined([_state(0, True, at=2.0), _state(1, None)]) == MemoryIntegrity(None)
    failed = combined([_state(0, None), _state(1, False, "slot 3 leaked", 1.0)])
    assert failed == MemoryIntegrity(False, "rank 1: slot 3 leaked", None)


def test_one_node_group_meets_through_a_file_in_the_servers_directory(tmp_path) -> None:
    """No --dist-init-addr on one node: no probed TCP port, which another program's connection
    could take before rank 0 binds it; a given address is used as it is."""
    args = ServerArgs(model_path="unused", tp_size=2)
    specs = rank_specs(args, str(tmp_path))
    assert [s.init_method for s in specs] == [f"file://{tmp_path}/tp-group"] * 2
    given = dataclasses.replace(args, dist_init_addr="10.0.0.1:29500")
    assert {s.init_method for s in rank_specs(given, str(tmp_path))} == {"tcp://10.0.0.1:29500"}
