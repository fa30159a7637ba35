"""`ProcessLanes` (constrained/compile_pool.py): compiles in worker processes that are
killed when no request waits for them any more, replaced when needed, and gone with the
server. Driven by a stand-in worker (`compile_worker_double`) whose keys are commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from constrained.base_grammar_backend import GrammarKey
from constrained.compile_pool import CompileCrashed, CompileStopped, ProcessLanes, abandoned

WORKER = "tests.constrained.compile_worker_double:main"
WAIT_S = 60


class Invalid(ValueError):
    pass


def decode(payload: object) -> object:
    """What the parent makes of a worker's answer: strings upper-cased, so a test sees it ran."""
    return payload.upper() if isinstance(payload, str) else payload


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone_soon(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def running(future: Future) -> None:
    deadline = time.monotonic() + WAIT_S
    while not future.running():
        assert time.monotonic() < deadline, "the compile never started"
        time.sleep(0.01)


@pytest.fixture
def lanes() -> Iterator[ProcessLanes]:
    lanes = ProcessLanes(WORKER, lambda: "init", decode, Invalid, workers=2)
    yield lanes
    lanes.shutdown()


def test_results_errors_and_the_small_lane(lanes: ProcessLanes) -> None:
    assert lanes.submit(("echo", "a"), small=False).result(WAIT_S) == "INIT:A"
    with pytest.raises(Invalid, match="bad grammar"):
        lanes.submit(("fail", "bad grammar"), small=True).result(WAIT_S)
    # A small grammar has a worker of its own: it is not stuck behind a long compile.
    long = lanes.submit(("sleep", 30), small=False)
    running(long)
    assert lanes.submit(("echo", "b"), small=True).result(WAIT_S) == "INIT:B"
    assert not long.done()
    long.cancel()


def test_a_result_too_big_to_ship_is_compiled_here() -> None:
    here: list[object] = []
    lanes = ProcessLanes(
        WORKER, lambda: "init", decode, Invalid, workers=1, compile_here=here.append
    )
    try:
        lanes.submit(("big", None), small=False).result(WAIT_S)
        assert here == [("big", None)]
    finally:
        lanes.shutdown()


def test_a_slow_compile_on_the_small_lane_moves_to_the_general_lane() -> None:
    lanes = ProcessLanes(WORKER, lambda: "init", decode, Invalid, workers=2, small_budget_s=0.3)
    try:
        slow = lanes.submit(("sleep", 5.0), small=True)  # judged small, yet slow
        running(slow)
        time.sleep(0.6)  # past the budget: it now runs on the general lane
        assert lanes.submit(("echo", "quick"), small=True).result(WAIT_S) == "INIT:QUICK"
        assert not slow.done(), "the small lane waited for the slow one"
        assert slow.result(WAIT_S) == 5.0
    finally:
        lanes.shutdown()


def test_a_running_compile_nobody_waits_for_is_killed_and_its_worker_replaced(
    lanes: ProcessLanes,
) -> None:
    pid = lanes.submit(("pid", None), small=False).result(WAIT_S)
    long = lanes.submit(("sleep", 300), small=False)
    running(long)
    assert not long.cancel()  # as for any future that runs, and it asks for a stop
    assert abandoned(long)  # so a cache hands it to no one
    with pytest.raises(CompileStopped):
        long.result(10)
    assert gone_soon(pid), "the killed worker still runs"
    new_pid = lanes.submit(("pid", None), small=False).result(WAIT_S)
    assert new_pid != pid and alive(new_pid)


def test_a_compile_cancelled_before_it_starts_never_runs(lanes: ProcessLanes) -> None:
    first = lanes.submit(("sleep", 0.5), small=False)
    queued = lanes.submit(("exit", 9), small=False)  # it would kill the worker if it ran
    assert queued.cancel() and queued.cancelled()
    assert first.result(WAIT_S) == 0.5
    pid = lanes.submit(("pid", None), small=False).result(WAIT_S)
    assert alive(pid)


def test_a_worker_that_dies_fails_only_its_compile(lanes: ProcessLanes) -> None:
    with pytest.raises(CompileCrashed):
        lanes.submit(("exit", 9), small=False).result(WAIT_S)
    assert lanes.submit(("echo", "after"), small=False).result(WAIT_S) == "INIT:AFTER"


def test_shutdown_ends_the_workers_and_stops_their_compiles() -> None:
    lanes = ProcessLanes(WORKER, lambda: "init", decode, Invalid, workers=2)
    long = lanes.submit(("sleep", 300), small=False)
    small_pid = lanes.submit(("pid", None), small=True).result(WAIT_S)
    running(long)
    deadline = time.monotonic() + WAIT_S
    while len(pids := lanes.pids()) < 2:  # the long one's worker is being forked
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert small_pid in pids
    lanes.shutdown()
    with pytest.raises(CompileStopped):
        long.result(10)
    assert all(gone_soon(pid) for pid in pids)
    assert lanes.submit(("echo", "late"), small=False).cancelled()


def test_the_zygote_ends_with_its_process(tmp_path) -> None:
    """A process that used compile workers is killed: its zygote and workers end too."""
    script = (
        "from constrained.compile_pool import ProcessLanes\n"
        f"lanes = ProcessLanes({WORKER!r}, lambda: 'init', str, ValueError, workers=1)\n"
        "print(lanes.submit(('pid', None), small=False).result(60), flush=True)\n"
        "import time; time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        zygote = _ppid(worker)
        assert _ppid(zygote) == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert gone_soon(zygote) and gone_soon(worker)


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def test_a_stopped_compile_is_a_cache_miss() -> None:
    """Through the backend: a new request for the grammar of a stopped compile starts a
    new compile instead of getting the stopped one's error."""
    from tests.constrained.test_grammar_cache import FakeBackend

    class ProcessBackend(FakeBackend):
        def process_lanes(self, workers: int) -> ProcessLanes:
            return ProcessLanes(WORKER, lambda: "init", decode, Invalid, workers)

    backend = ProcessBackend()
    backend.configure(compile_threads=2, isolation="process")
    try:
        key = GrammarKey("regex", "x" * 5000)  # big: the general lane
        backend.lanes.submit = _as_sleep(backend.lanes.submit)  # type: ignore[method-assign]
        first = backend.compile_async(key)
        running(first)
        first.cancel()
        again = backend.compile_async(key)
        assert again is not first
        with pytest.raises(CompileStopped):
            first.result(10)
        again.cancel()
    finally:
        backend.shutdown()


def _as_sleep(submit):  # the stand-in worker takes commands, not grammar keys
    return lambda key, small: submit(("sleep", 300), small)
