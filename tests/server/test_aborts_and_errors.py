"""Aborts, request validation and error bodies, against a real server with a 1024-token KV
pool:

- an operator's `abort_all` and a request that outgrows the KV pool answer the OpenAI routes
  200 with the tokens so far and `finish_reason: "abort"` (streams: a last chunk with it,
  then `[DONE]`), as `/generate` does;
- an empty stop string is a 400 naming `stop` on every route;
- `/generate` and `/v1/completions` accept and refuse the same values, without coercion;
- error bodies are short and hold no internal source paths, whatever the client sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

POOL_TOKENS = 1024
TIMEOUT_S = 120
MAX_ERROR_BODY = 2048


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = Path(tmp_path_factory.mktemp("aborts_and_errors")) / "server.log"
    srv = ServerProcess(
        "--dtype", "float32", "--max-total-tokens", str(POOL_TOKENS), log_path=log
    )  # fmt: skip
    yield srv.url
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM: {srv.tail()}"


def server_state(url: str) -> dict[str, Any]:
    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_idle(url: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        state = server_state(url)
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


def wait_running(url: str) -> None:
    deadline = time.monotonic() + 60
    while server_state(url)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def abort_all(url: str) -> None:
    r = requests.post(url + "/abort_request", json={"abort_all": True}, timeout=10)
    assert r.status_code == 200, r.text


def data_events(resp: requests.Response) -> list[Any]:
    events: list[Any] = []
    for line in resp.iter_lines():
        if line and not line.startswith(b":"):  # an SSE comment is a keep-alive
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: ") :]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def assert_ends_with_abort(events: list[Any]) -> None:
    """The stream's last chunk carries finish_reason "abort", then `[DONE]`; no error."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "abort", last


# ---- item 4: aborts that are neither the client's fault nor a server failure ----------


def test_request_outgrowing_the_kv_pool_keeps_its_tokens(url: str) -> None:
    the = requests.post(
        url + "/tokenize", json={"prompt": " the", "add_special_tokens": False}, timeout=10
    ).json()["tokens"][0]
    prompt = [the[0] if isinstance(the, list) else the] * (POOL_TOKENS - 64)
    body = {"prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    r = requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "abort"
    produced = r.json()["usage"]["completion_tokens"]
    assert 0 < produced < 1000 and choice["text"]

    with requests.post(
        url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=TIMEOUT_S
    ) as resp:
        assert resp.status_code == 200
        events = data_events(resp)
    assert_ends_with_abort(events)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    assert wait_idle(url)["memory_integrity"]["ok"] is not False


def test_operator_abort_of_a_non_streaming_completion_is_200(url: str) -> None:
    out: dict[str, requests.Response] = {}
    body = {"prompt": "Write a long story.", "max_tokens": 900, "ignore_eos": True}

    def run() -> None:
        out["r"] = requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)

    thread = threading.Thread(target=run)
    thread.start()
    wait_running(url)
    abort_all(url)
    thread.join(TIMEOUT_S)
    r = out["r"]
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "abort"
    assert r.json()["usage"]["completion_tokens"] < 900
    wait_idle(url)


def test_operator_abort_of_a_chat_stream_ends_with_an_abort_chunk(url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with requests.post(
        url + "/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT_S
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        events: list[Any] = []
        for line in lines:  # the role chunk, then the first content chunk
            if line.startswith(b"data: "):
                events.append(orjson.loads(line[len(b"data: ") :]))
                if events[-1]["choices"][0]["delta"].get("content"):
                    break
        abort_all(url)
        for line in lines:
            if line:
                payload = line[len(b"data: ") :]
                events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    assert_ends_with_abort(events)
    wait_idle(url)


# ---- item 7: empty stop strings, one set of limits, short clean errors ------------------


@pytest.mark.parametrize("stop", ["", ["END", ""]])
@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_empty_stop_string_is_refused(url: str, route: str, stop: Any) -> None:
    if route == "/generate":
        body: dict[str, Any] = {
            "text": "Hi",
            "sampling_params": {"max_new_tokens": 4, "stop": stop},
        }
    elif route == "/v1/completions":
        body = {"prompt": "Hi", "max_tokens": 4, "stop": stop}
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stop": stop}
    r = requests.post(url + route, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"


NATIVE_NAME = {"max_tokens": "max_new_tokens"}
# (OpenAI field, value): each refused on both routes or accepted on both.
VALUES: list[tuple[str, Any]] = [
    ("temperature", 1e9),
    ("temperature", 2.5),
    ("temperature", 2.0),
    ("temperature", "0.5"),
    ("max_tokens", "2"),
    ("max_tokens", 2.0),
    ("n", 2.0),
    ("n", 65),
    ("ignore_eos", "true"),
    ("stop", ["x"] * 17),
    ("stop", ["x"] * 16),
    ("presence_penalty", -2.5),
]


@pytest.mark.parametrize(("field", "value"), VALUES)
def test_generate_and_completions_agree(url: str, field: str, value: Any) -> None:
    base = {"max_tokens": 2} if field != "max_tokens" else {}
    openai = requests.post(
        url + "/v1/completions", json={"prompt": "Hi", **base, field: value}, timeout=TIMEOUT_S
    )
    native_params = {NATIVE_NAME.get(k, k): v for k, v in {**base, field: value}.items()}
    native = requests.post(
        url + "/generate", json={"text": "Hi", "sampling_params": native_params}, timeout=TIMEOUT_S
    )
    assert openai.status_code == native.status_code, (openai.text, native.text)
    if native.status_code == 400:
        assert native.json()["error"]["param"] == NATIVE_NAME.get(field, field)
        assert openai.json()["error"]["param"] == field


def test_coerced_values_are_refused(url: str) -> None:
    for field, value in [("stream", "true"), ("echo", "true"), ("logprobs", "2"), ("seed", "1")]:
        body = {"prompt": "Hi", "max_tokens": 2, field: value}
        r = requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


DEPTH = 5000
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * DEPTH + '{"type": 7}' + "}}" * DEPTH


def assert_short_clean_error(r: requests.Response, status: int) -> None:
    assert r.status_code == status, r.text[:500]
    assert len(r.content) <= MAX_ERROR_BODY, len(r.content)
    for internal in (".cc:", ".h:", "/project/", "Check failed", "The JSON string is"):
        assert internal not in r.text, r.text


def test_deep_invalid_schema_error_is_short_and_clean(url: str) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "json_schema": DEEP_SCHEMA}}
    r = requests.post(url + "/generate", json=body, timeout=TIMEOUT_S)
    assert_short_clean_error(r, 400)
    # Refused by a grammar cap (its size) before it reaches xgrammar, whose own recursion
    # error is cleaned too (tests/constrained/test_grammar_error_messages.py).
    assert "--grammar-max-schema-bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "json_schema"
    stream = requests.post(url + "/generate", json={**body, "stream": True}, timeout=TIMEOUT_S)
    assert_short_clean_error(stream, 400)


def test_deeply_nested_response_format_is_a_400(url: str) -> None:
    # 1000 levels: under orjson's 1024, over what json.dumps can encode (built as text, since
    # neither encoder here can write it either).
    schema = '{"anyOf": ' * 1000 + '{"type": "string"}' + "}" * 1000
    data = (
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
        '"response_format": {"type": "json_schema", "json_schema": {"schema": ' + schema + "}}}"
    )
    r = requests.post(
        url + "/v1/chat/completions",
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert_short_clean_error(r, 400)
    assert r.json()["error"]["param"] == "response_format"


def test_long_model_name_is_not_echoed_in_full(url: str) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "model": "m" * 200_000}
    r = requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert_short_clean_error(r, 400)  # any name is served, but one this long is refused
    assert r.json()["error"]["param"] == "model"
