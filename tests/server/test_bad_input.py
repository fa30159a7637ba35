"""Malformed requests get a 4xx with an error JSON, and the server stays healthy."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.slow

LONG = "hello " * 9000  # more tokens than the context length (8192)

CASES = [
    # (route, body (bytes = raw), expected status, param or None)
    ("/generate", b"{not json", 400, None),
    ("/generate", b"[1, 2]", 400, None),
    ("/generate", {}, 400, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    ("/generate", {"text": 5}, 400, "text"),
    ("/generate", {"input_ids": "abc"}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, -3]}, 400, "input_ids"),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("/generate", {"input_ids": []}, 400, None),
    ("/generate", {"text": []}, 400, "text"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": "ten"}},
        400,
        "max_new_tokens",
    ),
    ("/generate", {"text": "a", "sampling_params": {"n": 0}}, 400, "n"),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"stop": [1, 2]}}, 400, "stop"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"stop_token_ids": [10**9]}},
        400,
        "stop_token_ids",
    ),
    ("/generate", {"text": "a", "sampling_params": "greedy"}, 400, "sampling_params"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a"}},
        400,
        "regex",
    ),
    ("/generate", {"text": LONG}, 400, "input_ids"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 100000}},
        400,
        "max_new_tokens",
    ),
    (
        "/generate",
        {"text": "a", "return_logprob": True, "top_logprobs_num": -1},
        400,
        "top_logprobs_num",
    ),
    (
        "/generate",
        {"text": "a", "return_logprob": True, "logprob_start_len": 5},
        400,
        "logprob_start_len",
    ),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ("/generate", {"text": "a", "stream": "yes"}, 400, "stream"),
    ("/abort_request", {}, 400, "rid"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": ["x"]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "model": "m" * 2000}, 400, "model"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, None),
    ("/v1/chat/completions", b"{", 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
        400,
        "presence_penalty",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), CASES)
def test_malformed_request(url: str, route: str, body, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        r = requests.post(
            url + route, data=body, headers={"Content-Type": "application/json"}, timeout=30
        )
    else:
        r = requests.post(url + route, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_unknown_route_and_method(url: str) -> None:
    r = requests.get(url + "/no/such/route", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = requests.get(url + "/generate", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_server_healthy_after_bad_input(url: str) -> None:
    for route, body, _, _ in CASES[:10]:
        requests.post(url + route, json=body if isinstance(body, dict) else None, timeout=30)
    assert requests.get(url + "/health", timeout=10).status_code == 200
    r = requests.post(
        url + "/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["text"].startswith(" Paris")
    state = requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["memory_integrity"]["ok"] is not False
