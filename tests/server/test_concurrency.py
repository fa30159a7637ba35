"""Many concurrent streams, client disconnects and explicit aborts: every request ends, and
afterwards nothing runs and the KV pool's integrity check holds."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
import requests

pytestmark = pytest.mark.slow

NUM_STREAMS = 64
NUM_CLOSED = 16
NEW_TOKENS = 16


def server_state(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server_state(url)
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
            return state
        time.sleep(0.2)
    raise AssertionError(f"server not idle after {timeout} s: {state}")


def stream_one(url: str, i: int, close_after: int | None, results: dict) -> None:
    params = {"max_new_tokens": 512 if close_after else NEW_TOKENS, "ignore_eos": True}
    body = {
        "text": f"Request {i}: tell me a story about",
        "sampling_params": params,
        "stream": True,
    }
    with requests.Session() as session:
        resp = session.post(url + "/generate", json=body, stream=True, timeout=300)
        events = 0
        last = None
        for line in resp.iter_lines():
            if not line or line.startswith(b":"):  # blank, or an SSE comment (keep-alive)
                continue
            if line == b"data: [DONE]":
                break
            last = orjson.loads(line[len(b"data: ") :])
            events += 1
            if close_after is not None and events >= close_after:
                resp.close()  # the client goes away mid-stream
                results[i] = ("closed", events)
                return
        results[i] = ("done", last)


def test_64_streams_with_16_disconnects(url: str) -> None:
    before = server_state(url)
    results: dict[int, tuple] = {}
    threads = [
        threading.Thread(target=stream_one, args=(url, i, 3 if i % 4 == 0 else None, results))
        for i in range(NUM_STREAMS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == NUM_STREAMS
    closed = [i for i, (kind, _) in results.items() if kind == "closed"]
    done = {i: out for i, (kind, out) in results.items() if kind == "done"}
    assert len(closed) == NUM_CLOSED and len(done) == NUM_STREAMS - NUM_CLOSED
    for out in done.values():
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert len(out["output_ids"]) == NEW_TOKENS

    state = wait_idle(url)
    # Each disconnect became an abort in the scheduler (those requests asked for 512 tokens,
    # so none could have finished on its own by now).
    assert state["num_aborted_reqs"] - before["num_aborted_reqs"] >= NUM_CLOSED
    assert state["memory_integrity"]["ok"] is True, state["memory_integrity"]
    assert state["token_usage"] == 0.0


def test_abort_request_route(url: str) -> None:
    out: dict = {}

    def run() -> None:
        body = {
            "text": "Write a very long essay about the sea.",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            "rid": "to-abort-1",
        }
        out["r"] = requests.post(url + "/generate", json=body, timeout=300)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server_state(url)["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = requests.post(url + "/abort_request", json={"rid": "to-abort-1"}, timeout=10)
    assert r.status_code == 200
    t.join(60)
    resp = out["r"]
    assert resp.status_code == 200, resp.text
    reason = resp.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert resp.json()["meta_info"]["completion_tokens"] < 2000
    state = wait_idle(url)
    assert state["memory_integrity"]["ok"] is True
