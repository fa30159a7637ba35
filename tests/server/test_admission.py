"""Admission control on a real server: a bounded queue answers 503 with Retry-After, a
request's `timeout` fails it while queued, `priority` needs the flag, and a queued stream gets
its headers (and keep-alives) before its first token.

One server: 2 running requests at most, 4 queued at most. Latencies are printed, not asserted
(a loaded 2-core machine breaks absolute bounds); the assertions are about order instead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests

from bench import burst
from tests.server.server_process import ServerProcess

MAX_RUNNING = 2
MAX_QUEUED = 4
FILL_TOKENS = 4000  # fillers run until they are aborted
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = Path(tmp_path_factory.mktemp("admission")) / "server.log"
    srv = ServerProcess(
        "--dtype", "float32",
        "--max-total-tokens", "32768",
        "--max-running-requests", str(MAX_RUNNING),
        "--max-queued-requests", str(MAX_QUEUED),
        log_path=log,
    )  # fmt: skip
    yield srv.url
    code = srv.stop()
    assert code == 0, f"server exited with {code}: {srv.tail()}"


def state(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_until(url: str, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = state(url)
        if pred(s):
            return s
        time.sleep(0.05)
    raise AssertionError(f"server state not reached in {timeout} s: {s}")


def assert_idle_and_clean(url: str) -> None:
    s = wait_until(url, lambda s: s["num_running_reqs"] == 0 and s["num_queue_reqs"] == 0)
    assert s["token_usage"] == 0, s
    assert s["memory_integrity"]["ok"] is True, s["memory_integrity"]


def body(i: int, max_new_tokens: int, **extra) -> dict:
    return {
        "text": f"Request {i}: write a long story about a lighthouse keeper",
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }


class Fillers:
    """`n` long requests that occupy the running slots (and the queue) until aborted."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.threads = [
            threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        r = requests.post(self.url + "/generate", json=body(i, FILL_TOKENS), timeout=TIMEOUT_S)
        self.statuses.append(r.status_code)

    def stop(self) -> None:
        requests.post(self.url + "/abort_request", json={"abort_all": True}, timeout=30)
        for t in self.threads:
            t.join(TIMEOUT_S)
        assert self.statuses == [200] * len(self.threads), self.statuses


def assert_overloaded(resp: requests.Response) -> dict:
    assert resp.status_code == 503, (resp.status_code, resp.text)
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    return error


@pytest.mark.slow
def test_40_concurrent_requests_overflow_with_fast_503s(url: str) -> None:
    """`bench/burst.py` against this server: its plumbing, and the refusals' order."""
    record = burst.main(["--url", url, "--n", "40", "--input-len", "64", "--output-len", "48"])
    assert record["other"] == [] and record["requests"] == 40
    assert record["completed"] >= MAX_RUNNING + MAX_QUEUED, record
    assert record["refused_503"] == 40 - record["completed"] > 0, record
    assert record["refused_after_first_completion"] == 0, record
    assert record["memory_integrity"]["ok"] is True, record
    assert record["memory_integrity"]["token_usage_idle"] == 0, record
    refusal = record["refusal"]
    print(f"\n503 latency ms: median {refusal['median_ms']:.1f}, max {refusal['max_ms']:.1f}")


@pytest.mark.slow
def test_request_timeout_behind_a_long_queue(url: str) -> None:
    fillers = Fillers(url, MAX_RUNNING)
    try:
        wait_until(url, lambda s: s["num_running_reqs"] == MAX_RUNNING)
        t0 = time.monotonic()
        r = requests.post(url + "/generate", json=body(99, 8, timeout=1), timeout=TIMEOUT_S)
        late = time.monotonic() - t0 - 1.0
        error = assert_overloaded(r)
        assert "timed out after 1 s" in error["message"], error
        assert "waiting for admission" in error["message"], error
        print(f"\nqueued request with timeout 1 s answered {1000 * late:.0f} ms after its deadline")
        assert late >= 0
    finally:
        fillers.stop()
    assert_idle_and_clean(url)
    # Admitted at once, it times out while running: the output so far, finish reason abort.
    r = requests.post(url + "/generate", json=body(98, FILL_TOKENS, timeout=1), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "timed out after 1 s" in reason["message"], reason
    assert 0 < out["meta_info"]["completion_tokens"] < FILL_TOKENS
    assert_idle_and_clean(url)  # its KV went back


def test_priority_and_timeout_are_checked(url: str) -> None:
    cases = [
        ("/generate", {"text": "Hi", "priority": 1}, "priority"),
        ("/generate", {"text": "Hi", "priority": "high"}, "priority"),
        ("/generate", {"text": "Hi", "timeout": 0}, "timeout"),
        ("/generate", {"text": "Hi", "timeout": "1"}, "timeout"),
        ("/v1/completions", {"prompt": "Hi", "priority": 2}, "priority"),
        ("/v1/completions", {"prompt": "Hi", "timeout": -1}, "timeout"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "priority": 2},
         "priority"),
    ]  # fmt: skip
    for path, payload, param in cases:
        r = requests.post(url + path, json=payload, timeout=TIMEOUT_S)
        assert r.status_code == 400, (path, payload, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = requests.post(url + "/generate", json={**body(0, 1), "priority": 0}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text  # the default priority changes nothing


def read_sse(resp: requests.Response) -> tuple[bytes, list[bytes], list[dict]]:
    """(the raw stream, its comment lines, its data payloads)."""
    raw = b"".join(resp.iter_content(None))
    comments, data = [], []
    for line in raw.split(b"\n"):
        if line.startswith(b":"):
            comments.append(line)
        elif line.startswith(b"data: ") and line != b"data: [DONE]":
            data.append(orjson.loads(line[len(b"data: ") :]))
    return raw, comments, data


def sglang_client_lines(raw: bytes) -> list[Any]:
    """A native stream read as SGLang's `bench_serving` reads it: every non-blank line,
    stripped of `data: `, is `[DONE]` or JSON (it raises on anything else)."""
    out = []
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line:
            continue
        line = line[6:] if line.startswith(b"data: ") else line
        out.append(line if line == b"[DONE]" else orjson.loads(line))
    return out


STREAMS = {
    "/generate": lambda: body(7, 8, stream=True, timeout=2.5),
    "/v1/chat/completions": lambda: {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 8,
        "stream": True,
        "timeout": 2.5,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(STREAMS))
def test_queued_stream_gets_headers_then_keepalives(url: str, path: str) -> None:
    fillers = Fillers(url, MAX_RUNNING)
    try:
        wait_until(url, lambda s: s["num_running_reqs"] == MAX_RUNNING)
        t0 = time.monotonic()
        with requests.post(url + path, json=STREAMS[path](), stream=True, timeout=30) as r:
            headers_s = time.monotonic() - t0
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert state(url)["num_queue_reqs"] == 1  # still queued: no token yet
            raw, comments, data = read_sse(r)
        print(f"\n{path}: headers after {headers_s:.2f} s while queued")
        if path == "/generate":
            # Blank lines, which SGLang's clients skip, instead of comments they cannot parse.
            assert raw.startswith(b"\n") and not comments
            assert sglang_client_lines(raw)[-1] == b"[DONE]"
        else:
            assert comments and comments[0] == b": keep-alive"
        # Its timeout passed while queued: an error event, not an HTTP status any more.
        [event] = data
        assert event["error"]["code"] == 503 and "timed out" in event["error"]["message"]
    finally:
        fillers.stop()
    assert_idle_and_clean(url)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(STREAMS))
def test_stream_refused_by_a_full_queue_gets_503(url: str, path: str) -> None:
    # The queued ones are sent once the running ones are admitted (sent together, they could
    # all reach the scheduler before its next step and overflow the queue themselves).
    running = Fillers(url, MAX_RUNNING)
    queued = None
    try:
        wait_until(url, lambda s: s["num_running_reqs"] == MAX_RUNNING)
        queued = Fillers(url, MAX_QUEUED)
        wait_until(url, lambda s: s["num_queue_reqs"] == MAX_QUEUED)
        r = requests.post(url + path, json=STREAMS[path](), stream=True, timeout=30)
        assert_overloaded(r)
    finally:
        running.stop()
        if queued is not None:
            queued.stop()
    assert_idle_and_clean(url)


def test_burst_refused_without_the_scheduler(url: str) -> None:
    """The main process refuses what its own counts show over the bound, in any arrival
    order: with the scheduler stopped (as it is, in effect, during a long prefill step) a
    burst of 10 gets its 4 refusals at once, and the 6 admitted complete once it resumes."""
    n = MAX_RUNNING + MAX_QUEUED + 4
    results: list[requests.Response] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = requests.post(url + "/generate", json=body(i, 4), timeout=TIMEOUT_S)
        with lock:
            results.append(r)

    scheduler_pid = state(url)["pid"]
    os.kill(scheduler_pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < n - MAX_RUNNING - MAX_QUEUED and time.monotonic() < deadline:
            time.sleep(0.05)
        with lock:
            refused = list(results)
    finally:
        os.kill(scheduler_pid, signal.SIGCONT)
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(refused) == n - MAX_RUNNING - MAX_QUEUED, [r.status_code for r in refused]
    for r in refused:
        assert "--max-queued-requests" in assert_overloaded(r)["message"]
    assert sorted(r.status_code for r in results) == [200] * (MAX_RUNNING + MAX_QUEUED) + [503] * 4
    assert_idle_and_clean(url)
