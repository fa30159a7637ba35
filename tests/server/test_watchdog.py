"""The scheduler's step watchdog, end to end: a forward that never returns (the model worker's
test hook) makes /health fail, fails the open request with a 503, and ends the server with a
non-zero status and a log line naming the watchdog, leaving no child process behind. A
scheduler too stuck for its own watchdog is killed by the main process. And the watchdog
alone, in a subprocess."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from srt.entrypoints.serve import HEARTBEAT_KILL_GRACE_S
from srt.environ import TEST_HANG_AT_FORWARD
from srt.utils.process import WATCHDOG_EXIT_CODE
from tests.server.server_process import ServerProcess, alive

WATCHDOG_S = 3.0
SLACK_S = 30.0  # generous: the machine may be busy; the point is "fails", not "how fast"


def start_server(log: Path, model: str) -> ServerProcess:
    """A small server whose watchdog fires after WATCHDOG_S seconds. The watchdog and the
    heartbeat do not depend on the model, so it serves the tiny one (a faster start)."""
    return ServerProcess(
        "--model-path", model, "--dtype", "float32", "--max-total-tokens", "4096",
        "--watchdog-timeout", str(WATCHDOG_S),
        log_path=log,
    )  # fmt: skip


def assert_children_gone(children: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)], "orphaned child processes"


def health(url: str) -> int | None:
    try:
        return requests.get(url + "/health", timeout=5).status_code
    except requests.RequestException:
        return None  # the server is already gone: also not healthy


def test_hung_forward_fails_health_and_exits_nonzero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_served_model: str
) -> None:
    monkeypatch.setenv(TEST_HANG_AT_FORWARD.name, "1")  # the server inherits the environment
    log = tmp_path / "server.log"
    srv = start_server(log, tiny_served_model)
    try:
        children = list(srv.children)
        assert children, "the server has no child processes"
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
        with cf.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(requests.post, srv.url + "/generate", json=body, timeout=120)
            deadline = time.monotonic() + WATCHDOG_S + SLACK_S
            while (code := health(srv.url)) == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert code != 200, "/health stayed 200 with a hung forward"
            r = reply.result()
        assert r.status_code == 503, r.text
        assert "watchdog" in r.json()["error"]["message"]

        rc = srv.proc.wait(60)
        assert rc != 0
        text = log.read_text()
        assert "Scheduler watchdog: a scheduler step (" in text, text[-4000:]
        assert f"exited unexpectedly (code {WATCHDOG_EXIT_CODE}: its watchdog" in text
        assert "Test hook: forward 1 hangs." in text  # the dumped stack points at the hook
        assert_children_gone(children)
    finally:
        still_running = srv.proc.poll() is None
        srv.stop()  # closes the log; kills the server only if the test failed early
        if still_running:
            pytest.fail("the server did not exit")


def test_stopped_scheduler_is_killed_by_the_main_process(
    tmp_path: Path, tiny_served_model: str
) -> None:
    """A scheduler too stuck even for its own watchdog (here: SIGSTOP; in life, a call that
    holds the GIL) stops sending heartbeats: /health fails, and the main process kills it
    once it has been silent for --watchdog-timeout + HEARTBEAT_KILL_GRACE_S."""
    log = tmp_path / "server.log"
    srv = start_server(log, tiny_served_model)
    try:
        children = list(srv.children)
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        scheduler_pid = info["internal_states"][0]["pid"]
        os.kill(scheduler_pid, signal.SIGSTOP)
        deadline = time.monotonic() + WATCHDOG_S + SLACK_S
        while (code := health(srv.url)) == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert code != 200, "/health stayed 200 with a stopped scheduler"
        rc = srv.proc.wait(WATCHDOG_S + HEARTBEAT_KILL_GRACE_S + SLACK_S)
        assert rc != 0
        assert "exited unexpectedly (killed by the main process: no heartbeat" in log.read_text()
        assert_children_gone(children)
    finally:
        still_running = srv.proc.poll() is None
        srv.stop()
        if still_running:
            pytest.fail("the server did not exit")


WATCHDOG_SCRIPT = """
import logging, sys, time
from managers.scheduler_process import StepWatchdog
logging.basicConfig(level=logging.INFO)
dog = StepWatchdog(float(sys.argv[1]), lambda: "the test step")
dog.start()
for _ in range(20):  # quick iterations never fire it
    dog.begin(); time.sleep(0.05); dog.end()
dog.begin()
time.sleep(float(sys.argv[2]))
print("step finished", flush=True)
"""


@pytest.mark.parametrize(("step_s", "fires"), [(0.2, False), (30.0, True)])
def test_step_watchdog_exits_only_past_its_timeout(step_s: float, fires: bool) -> None:
    tic = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT, "0.5", str(step_s)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if not fires:
        assert out.returncode == 0 and "step finished" in out.stdout, out.stderr
        return
    assert out.returncode == WATCHDOG_EXIT_CODE, out.stderr
    assert time.monotonic() - tic < 20  # well before the step would have ended
    assert "Scheduler watchdog: the test step has run" in out.stderr
    assert "most recent call first" in out.stderr  # every thread's stack
