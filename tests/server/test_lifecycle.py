"""Process lifecycle: SIGTERM exits cleanly, a killed scheduler takes the server down fast,
and no child process outlives the server. Also the API key."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import requests

from tests.server.server_process import ServerProcess, alive

pytestmark = pytest.mark.slow

SMALL = ("--max-total-tokens", "4096")


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_options_server_then_sigterm(tmp_path, tiny_served_model: str) -> None:
    """--api-key, --served-model-name and --chat-template; then SIGTERM exits 0. A tiny
    model: the flags and the exit are checked, not its outputs."""
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(
        *SMALL,
        "--model-path",
        tiny_served_model,
        "--api-key",
        "sekrit",
        "--served-model-name",
        "my-model",
        "--chat-template",
        str(template),
        log_path=tmp_path / "log",
    )
    auth = {"Authorization": "Bearer sekrit"}
    try:
        assert len(srv.children) >= 2  # scheduler, detokenizer (+ mp's resource tracker)
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200  # open
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(srv.url + "/generate", json=body, headers=headers, timeout=30)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == 401
        assert requests.get(srv.url + "/v1/models", timeout=30).status_code == 401
        ok = requests.post(srv.url + "/generate", json=body, headers=auth, timeout=30)
        assert ok.status_code == 200, ok.text

        models = requests.get(srv.url + "/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        messages = [{"role": "user", "content": "Hello"}]
        chat = requests.post(
            srv.url + "/v1/chat/completions",
            json={"model": "my-model", "messages": messages, "max_tokens": 1},
            headers=auth,
            timeout=60,
        ).json()
        expected = requests.post(
            srv.url + "/tokenize",
            json={"prompt": "<user>Hello<assistant>", "add_special_tokens": False},
            headers=auth,
            timeout=30,
        ).json()["count"]
        assert chat["usage"]["prompt_tokens"] == expected
    finally:
        code = srv.stop(signal.SIGTERM)
    assert code == 0, srv.tail()
    time.sleep(0.5)
    assert not [p for p in srv.children if alive(p)]


def test_killed_scheduler_takes_server_down(tmp_path, tiny_served_model: str) -> None:
    """A tiny model: the processes are checked, not outputs. The kill comes once the stream
    has its first token, so the request is surely running."""
    srv = ServerProcess(*SMALL, "--model-path", tiny_served_model, log_path=tmp_path / "log")
    info = requests.get(srv.url + "/get_server_info", timeout=30).json()
    scheduler_pid = info["internal_states"][0]["pid"]
    assert scheduler_pid in srv.children

    stream_end: dict = {}
    streaming = threading.Event()

    def in_flight() -> None:
        body = {
            "text": "Tell me a long story.",
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            "stream": True,
        }
        try:
            with requests.post(srv.url + "/generate", json=body, stream=True, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()
            stream_end["last"] = lines[-2:] if lines else []
        except requests.RequestException as e:
            stream_end["error"] = repr(e)
        streaming.set()
        stream_end["t"] = time.monotonic()

    t = threading.Thread(target=in_flight)
    t.start()
    assert streaming.wait(60), "no token streamed"
    assert "t" not in stream_end, f"the stream ended before the kill: {stream_end}"
    killed_at = time.monotonic()
    os.kill(scheduler_pid, signal.SIGKILL)
    try:
        code = srv.proc.wait(10)
    except subprocess.TimeoutExpired:
        srv.stop(signal.SIGKILL)
        raise AssertionError(f"server still alive 10 s after its scheduler died: {srv.tail()}")
    assert code != 0
    assert "scheduler process" in srv.tail().lower()
    t.join(15)
    assert "t" in stream_end and stream_end["t"] - killed_at < 10, stream_end
    if "last" in stream_end:  # the stream ended with an error event, not a fake success
        assert b"error" in b"".join(stream_end["last"]), stream_end
    time.sleep(0.5)
    assert not [p for p in srv.children if alive(p)], "a child outlived the server"
    srv.stop()
