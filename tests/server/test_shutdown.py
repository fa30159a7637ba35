"""SIGTERM under load: the server stops taking requests (JSON 503), lets
running ones finish for --shutdown-grace-period seconds, then fails the rest as it does when
a child dies (a JSON 503; a stream gets an error event, then [DONE]); it exits 0, leaves no
child behind and logs no traceback. Before the fix, streams were cut off with neither an
error nor [DONE] and non-streaming requests got a plain-text 500."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import orjson
import pytest
import requests

from tests.server.server_process import ServerProcess, alive

pytestmark = pytest.mark.slow

GRACE_S = 4.0
LONG = {"max_new_tokens": 600, "ignore_eos": True}  # cannot finish within the grace period
SHORT = {"max_new_tokens": 8, "ignore_eos": True}  # finishes within it


class Client:
    """One request on a thread: its status, content type and (stream) lines or body."""

    def __init__(self, url: str, route: str, body: dict) -> None:
        self.started = threading.Event()
        self.status: int | None = None
        self.content_type = ""
        self.lines: list[bytes] = []
        self.body = b""
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(url, route, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, route: str, body: dict) -> None:
        try:
            with requests.post(url + route, json=body, stream=True, timeout=120) as r:
                self.status = r.status_code
                self.content_type = r.headers.get("content-type", "")
                if not body.get("stream"):
                    self.body = r.content
                    return
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except requests.RequestException as e:
            self.error = repr(e)
        finally:
            self.started.set()

    def events(self) -> list[dict]:
        return [orjson.loads(x[len(b"data: ") :]) for x in self.lines if x != b"data: [DONE]"]

    def describe(self) -> str:
        return f"status={self.status} error={self.error} tail={self.lines[-2:]} body={self.body[:200]!r}"


def assert_json_503(status: int | None, content_type: str, body: bytes, what: str) -> None:
    assert status == 503 and content_type.startswith("application/json"), (what, status, body)
    assert orjson.loads(body)["error"]["code"] == 503


def test_sigterm_under_load_drains_then_fails_the_rest(tmp_path) -> None:
    log = tmp_path / "server.log"
    srv = ServerProcess(
        "--max-total-tokens", "16384", "--shutdown-grace-period", str(GRACE_S), log_path=log
    )
    url = srv.url
    try:
        prompt = "Tell me a very long story about the sea."
        waiting = [
            Client(url, "/generate", {"text": prompt, "sampling_params": LONG}),
            Client(
                url, "/v1/completions", {"prompt": prompt, "max_tokens": 600, "ignore_eos": True}
            ),
        ]
        streams = [
            Client(
                url,
                "/generate",
                {"text": f"{i}: {prompt}", "sampling_params": LONG, "stream": True},
            )
            for i in range(4)
        ] + [
            Client(
                url,
                "/v1/completions",
                {"prompt": f"{i}: {prompt}", "max_tokens": 600, "ignore_eos": True, "stream": True},
            )
            for i in range(4)
        ]
        for c in streams:
            assert c.started.wait(120) and c.lines, c.describe()
        short = Client(url, "/generate", {"text": prompt, "sampling_params": SHORT, "stream": True})
        assert short.started.wait(60) and short.lines, short.describe()

        srv.proc.send_signal(signal.SIGTERM)
        # Draining: still listening, but refusing new work with a JSON 503.
        deadline = time.monotonic() + GRACE_S
        while requests.get(url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
            time.sleep(0.05)
        for route, body in (
            ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ):
            r = requests.post(url + route, json=body, timeout=30)
            assert_json_503(r.status_code, r.headers.get("content-type", ""), r.content, route)

        try:
            code = srv.proc.wait(GRACE_S + 30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still up long after SIGTERM: {srv.tail()}") from None
    finally:
        srv.stop(signal.SIGKILL)
    for c in [*waiting, *streams, short]:
        c.thread.join(30)
        assert c.error is None, c.describe()

    assert code == 0, srv.tail()
    # The short stream finished within the grace period.
    assert short.lines[-1] == b"data: [DONE]", short.describe()
    assert short.events()[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # The others were failed: a JSON 503, or an error event and then [DONE].
    for c in waiting:
        assert_json_503(c.status, c.content_type, c.body, c.describe())
    for c in streams:
        assert c.status == 200 and c.lines[-1] == b"data: [DONE]", c.describe()
        error = orjson.loads(c.lines[-2][len(b"data: ") :])
        assert error["error"]["code"] == 503, c.describe()
    text = log.read_text()
    assert "Traceback" not in text and "Cancel" not in text, text[-4000:]
    time.sleep(0.5)
    assert not [p for p in srv.children if alive(p)], "a child outlived the server"
