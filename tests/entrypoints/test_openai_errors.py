"""Errors: malformed bodies, unknown models / routes, refused and aborted requests, and a
client that hangs up mid-stream (the request must be aborted)."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import requests

from tests.entrypoints.fake_tokenizer_manager import (
    TRIGGER_ABORT,
    TRIGGER_CRASH,
    TRIGGER_REQUEST_ERROR,
    TRIGGER_SLOW,
    FakeTokenizerManager,
)
from tests.entrypoints.helpers import TIMEOUT_S, assert_error, post, sse_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

MALFORMED: list[tuple[str, dict[str, Any] | bytes, str | None]] = [
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": -5}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": -1}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
    (CHAT, {"messages": MSGS, "temperature": 2.5}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSGS, "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (CHAT, {"messages": MSGS, "n": 100}, "n"),
    (CHAT, {"messages": MSGS, "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "stop": ["s"] * 17}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, "stop"),
    (COMPLETIONS, b'{"prompt": "x",', None),
    (CHAT, b"not json at all", None),
    (CHAT, b"", None),
    (CHAT, b"[1, 2]", None),
    (CHAT, {"max_tokens": 3}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": 42}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 30}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": "many"}, "logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "stream": "sometimes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"messages": MSGS, "response_format": "json"}, "response_format"),
    (CHAT, {"messages": MSGS, "top_k": -2}, "top_k"),
]


@pytest.mark.parametrize(("path", "body", "param"), MALFORMED)
def test_malformed_body_is_400(
    base_url: str,
    tm: FakeTokenizerManager,
    path: str,
    body: dict[str, Any] | bytes,
    param: str | None,
) -> None:
    error = assert_error(post(base_url + path, body), 400, param)
    assert error["type"] == "BadRequestError"
    assert tm.received == []


def test_unknown_model_card_is_404(client: openai.OpenAI, base_url: str) -> None:
    """Only a model card is looked up by name: a completion serves any name (see
    test_openai_stream_usage.py), as on SGLang."""
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.status_code == 404
    error = assert_error(requests.get(f"{base_url}/v1/models/gpt-4", timeout=TIMEOUT_S), 404)
    assert error["param"] == "model" and error["type"] == "NotFoundError"
    resp = post(f"{base_url}{COMPLETIONS}", {"model": "gpt-4", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 200


def test_unknown_route_and_method(base_url: str) -> None:
    assert_error(requests.get(f"{base_url}/v1/nothing", timeout=TIMEOUT_S), 404)
    resp = requests.get(f"{base_url}{CHAT}", timeout=TIMEOUT_S)
    assert_error(resp, 405)
    assert "POST" in resp.headers.get("allow", "")


@pytest.mark.parametrize("stream", [False, True])
def test_tokenizer_manager_refusal(base_url: str, stream: bool) -> None:
    body = {"prompt": f"x {TRIGGER_REQUEST_ERROR}", "stream": stream}
    error = assert_error(post(f"{base_url}{COMPLETIONS}", body), 400, "prompt")
    assert "too long" in error["message"]
    chat = {"messages": [{"role": "user", "content": TRIGGER_REQUEST_ERROR}], "stream": stream}
    assert_error(post(f"{base_url}{CHAT}", chat), 400, "prompt")


def test_unexpected_error_is_500(base_url: str) -> None:
    error = assert_error(post(f"{base_url}{COMPLETIONS}", {"prompt": TRIGGER_CRASH}), 500)
    assert error["type"] == "InternalServerError"


def test_abort_non_streaming(base_url: str) -> None:
    body = {"messages": [{"role": "user", "content": TRIGGER_ABORT}], "max_tokens": 10}
    assert_error(post(f"{base_url}{CHAT}", body), 503)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_abort_mid_stream_is_an_sse_error(base_url: str, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 10, "stream": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": TRIGGER_ABORT}]
    else:
        body["prompt"] = TRIGGER_ABORT
    events = sse_events(base_url + path, body)
    *chunks, error_event, done = events
    assert done == "[DONE]" and len(chunks) >= 2
    assert error_event["error"]["code"] == 503
    assert error_event["error"]["message"] == "Aborted by the scheduler"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_client_disconnect_closes_the_generator(
    base_url: str, tm: FakeTokenizerManager, path: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 100_000, "stream": True, "n": 2}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": TRIGGER_SLOW}]
    else:
        body["prompt"] = [TRIGGER_SLOW, TRIGGER_SLOW + " again"]
    resp = requests.post(base_url + path, json=body, stream=True, timeout=TIMEOUT_S)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: {")
    resp.close()
    deadline = time.monotonic() + 5
    while len(tm.closed_early) < len(tm.received) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(tm.closed_early) == sorted(str(o.rid) for o in tm.received)
