"""A real server with `--speculative-algorithm`: streamed and whole outputs over HTTP equal a
plain server's, a client leaving mid-stream frees its slots, `/get_server_info` reports the
drafts, and the KV integrity check holds once idle. A tiny model with the default
tokenizer: what is checked is the serving path, not a model's text."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

# Repeats itself, so that prompt lookup drafts from the first token on.
PROMPT = "one two three four five six seven eight nine ten " * 4
PARAMS = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def start(model: str, log: Path, *extra: str, wait: bool = True) -> ServerProcess:
    return ServerProcess(
        "--model-path", model, "--dtype", "float32", "--max-total-tokens", "4096", *extra,
        log_path=log, wait=wait,
    )  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_served_model: str) -> Iterator[tuple]:
    folder = Path(tmp_path_factory.mktemp("speculative"))
    # Started together: a start is mostly one process's imports, so two share the cores.
    plain = start(tiny_served_model, folder / "plain.log", wait=False)
    spec = start(
        tiny_served_model,
        folder / "spec.log",
        "--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "1",
        wait=False,
    )  # fmt: skip
    for srv in (plain, spec):
        srv.wait_ready()
    yield plain.url, spec.url
    for srv in (plain, spec):
        assert srv.stop() == 0, srv.tail()


def generate(url: str, params: dict) -> list[int]:
    r = requests.post(
        url + "/generate", json={"text": PROMPT, "sampling_params": params}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def stream(url: str, params: dict) -> list[int]:
    body = {"text": PROMPT, "sampling_params": params, "stream": True}
    ids: list[int] = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ids = json.loads(line[6:])["output_ids"]
    return ids


def info(url: str) -> dict:
    """The scheduler's state (`/get_server_info`'s internal_states), with the verdict of its
    memory integrity check."""
    body = requests.get(url + "/get_server_info", timeout=30).json()
    return {**body["internal_states"][0], "memory_integrity": body["memory_integrity"]}


def test_outputs_over_http_equal_a_plain_server(servers: tuple[str, str]) -> None:
    plain, spec = servers
    sampled = {**PARAMS, "temperature": 0.8, "seed": 5}
    for params in (PARAMS, sampled):
        expected = generate(plain, params)
        assert generate(spec, params) == expected
        assert stream(spec, params) == expected
    state = info(spec)
    assert state["spec_draft_tokens"] > 0
    assert state["avg_spec_accept_length"] >= 1.0


def test_a_client_leaving_mid_stream_frees_its_drafts(servers: tuple[str, str]) -> None:
    _, spec = servers
    body = {"text": PROMPT, "sampling_params": {**PARAMS, "max_new_tokens": 400}, "stream": True}
    with requests.post(spec + "/generate", json=body, stream=True, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # closes the connection: the server aborts the request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = info(spec)
        if state["num_running_reqs"] == 0 and state["token_usage"] == 0:
            break
        time.sleep(0.2)
    state = info(spec)
    assert state["num_running_reqs"] == 0 and state["token_usage"] == 0
    assert state["memory_integrity"]["ok"], state["memory_integrity"]


def test_tensor_parallel_ranks_verify_the_same_drafts(
    tmp_path_factory: pytest.TempPathFactory, tiny_served_model: str, servers: tuple[str, str]
) -> None:
    """Both ranks of a `--tp-size 2` server draft alike (else their batches would differ and
    the step's collectives would not match): its outputs equal the plain server's."""
    plain, _ = servers
    log = Path(tmp_path_factory.mktemp("speculative-tp2")) / "server.log"
    tp2 = start(
        tiny_served_model, log,
        "--tp-size", "2", "--speculative-algorithm", "ngram",
        "--speculative-ngram-min-match-window-size", "1",
    )  # fmt: skip
    try:
        sampled = {**PARAMS, "temperature": 0.8, "seed": 5}
        for params in (PARAMS, sampled):
            assert generate(tp2.url, params) == generate(plain, params)
        state = info(tp2.url)
        assert state["spec_draft_tokens"] > 0
        assert state["memory_integrity"]["ok"], state["memory_integrity"]
    finally:
        assert tp2.stop() == 0, tp2.tail()
