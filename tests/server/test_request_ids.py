"""Request ids: a request with rid X and n > 1 also runs X-prefill and
X-0 .. X-(n-1) inside the server. No client rid may equal one of those while X runs, in
either order of arrival, or one client would receive (or abort) another's output."""

from __future__ import annotations

import threading
import uuid

import orjson
import pytest
import requests

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"  # the server is shared with other tests


class Stream:
    """A native stream read on a thread; `started` is set at its first event."""

    def __init__(self, url: str, body: dict) -> None:
        self.started = threading.Event()
        self.status: int | None = None
        self.events: list[dict] = []
        self.done = False
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with requests.post(url + "/generate", json={**body, "stream": True}, stream=True) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line or line.startswith(b":"):  # blank, or an SSE comment (keep-alive)
                    continue
                if line == b"data: [DONE]":
                    self.done = True
                    break
                self.events.append(orjson.loads(line[len(b"data: ") :]))
                self.started.set()
        self.started.set()

    def join(self) -> dict:
        self.thread.join(120)
        assert self.done and self.status == 200, (self.status, self.events[-1:])
        return self.events[-1]


def generate(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=120)


def assert_rid_refused(r: requests.Response) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "rid"


def test_n2_request_cannot_take_a_running_requests_rid(url: str) -> None:
    """The issue's repro: B runs with rid "victim-prefill", then A comes with rid "victim"
    and n = 2. Before the fix, B returned A's prefill output (0 tokens) and ran on alone."""
    victim = unique("victim")
    b = Stream(
        url, {"text": "Count to a hundred:", "sampling_params": LONG, "rid": f"{victim}-prefill"}
    )
    assert b.started.wait(60)
    a = generate(
        url, {"text": "Hello", "sampling_params": {"n": 2, "max_new_tokens": 4}, "rid": victim}
    )
    assert_rid_refused(a)
    out = b.join()
    assert out["meta_info"]["completion_tokens"] == LONG["max_new_tokens"], out["meta_info"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    # Once B is done, the name is free again.
    again = {"text": "Hello", "sampling_params": {"n": 2, "max_new_tokens": 2}, "rid": victim}
    assert generate(url, again).status_code == 200


def test_client_rid_cannot_take_a_derived_rid_of_a_running_request(url: str) -> None:
    parent = unique("parent")
    a = Stream(
        url, {"text": "Count to a hundred:", "sampling_params": {**LONG, "n": 2}, "rid": parent}
    )
    assert a.started.wait(60)
    one = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    for rid in (parent, f"{parent}-prefill", f"{parent}-0", f"{parent}-1"):
        assert_rid_refused(generate(url, {**one, "rid": rid}))
    a.join()
    final = [e for e in a.events if e["meta_info"]["finish_reason"]]
    assert sorted(e["index"] for e in final) == [0, 1]
    assert all(e["meta_info"]["completion_tokens"] == LONG["max_new_tokens"] for e in final)
    assert generate(url, {**one, "rid": f"{parent}-prefill"}).status_code == 200


def test_abort_reaches_only_the_named_request(url: str) -> None:
    """Aborting rid X must not abort a client's request named X-prefill (an n = 1 request X
    creates no X-prefill, so both may run)."""
    name = unique("abort")
    target = Stream(url, {"text": "Count to a hundred:", "sampling_params": LONG, "rid": name})
    bystander = Stream(
        url, {"text": "Count to a hundred:", "sampling_params": LONG, "rid": f"{name}-prefill"}
    )
    assert target.started.wait(60) and bystander.started.wait(60)
    r = requests.post(url + "/abort_request", json={"rid": name}, timeout=30)
    assert r.status_code == 200
    assert target.join()["meta_info"]["finish_reason"]["type"] == "abort"
    out = bystander.join()
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
