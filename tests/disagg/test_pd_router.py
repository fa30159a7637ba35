"""End to end behind sglang-router's PD mode: a prefill server, a decode server and the
router, with mooncake (TCP) and with nixl (UCX). Greedy outputs equal an aggregated run's;
concurrent streams complete; killing the prefill server fails in-flight requests in bounded
time and the decode server keeps serving.

Both clusters run a tiny random model with the default tokenizer (its servers start without
loading and prepacking the default model), compared with the same model in this process;
what is checked is the transfer and the bookkeeping, which do not depend on the weights. The
kill stops the prefill scheduler first, so its requests are in flight whatever the pace."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import orjson
import pytest
import requests

from tests.disagg.pd_cluster import PDCluster

pytestmark = pytest.mark.slow

TEXTS = [f"Fact number {i}: the" for i in range(8)] + [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Photosynthesis is the process by which plants",
    "Write a haiku about the moon:",
    "import numpy as np\n",
]
GREEDY = {"max_new_tokens": 16, "temperature": 0}
# Short enough that killing the prefill server fails the in-flight requests soon (and frees
# the decode server's quarantined slots), long enough for 32 concurrent streams of the tiny
# model on 2 cores (they take ~2 s).
TIMEOUTS = ("--disaggregation-timeout", "8", "--disaggregation-quarantine-timeout", "3")


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def cluster(request, tmp_path_factory):
    module = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}[request.param]
    pytest.importorskip(module, reason=f"{request.param} is not installed")
    pytest.importorskip("sglang_router")
    model = ["--model-path", request.getfixturevalue("tiny_served_model")]
    log_dir = tmp_path_factory.mktemp(f"pd-{request.param}")
    c = PDCluster(request.param, log_dir, *TIMEOUTS, *model)
    yield c
    c.stop()


def generate(url: str, text: str, params: dict) -> dict:
    r = requests.post(
        url + "/generate", json={"text": text, "sampling_params": params}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def aggregated(request: pytest.FixtureRequest) -> list[dict]:
    """Greedy outputs of an aggregated run of the cluster's model, in this process."""
    from managers.inprocess import InProcessDriver
    from srt.server_args import ServerArgs

    model = request.getfixturevalue("tiny_served_model")
    driver = InProcessDriver(ServerArgs(model_path=model, dtype="float32"))
    return driver.generate(TEXTS, GREEDY)


def test_greedy_equals_aggregated(cluster: PDCluster, request: pytest.FixtureRequest) -> None:
    with cf.ThreadPoolExecutor(8) as pool:
        pd = list(pool.map(lambda t: generate(cluster.url, t, GREEDY), TEXTS))
    agg = aggregated(request)
    assert [o["output_ids"] for o in pd] == [o["output_ids"] for o in agg]
    assert [o["text"] for o in pd] == [o["text"] for o in agg]
    for srv in (cluster.prefill, cluster.decode):
        state = requests.get(srv.url + "/get_server_info", timeout=30).json()
        assert state["internal_states"][0]["memory_integrity"]["ok"] is not False


def stream(url: str, i: int) -> dict:
    body = {
        "text": f"Story {i}: once upon a time",
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
        "stream": True,
    }
    last = None
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                last = orjson.loads(line[len(b"data: ") :])
    return last


def test_32_concurrent_streams(cluster: PDCluster) -> None:
    with cf.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda i: stream(cluster.url, i), range(32)))
    for out in outs:
        assert out is not None and "error" not in out, out
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert len(out["output_ids"]) == 24


def wait_idle(server_url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = requests.get(server_url + "/get_server_info", timeout=30).json()
        state = state["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
            return state
        time.sleep(0.3)
    raise AssertionError(f"not idle after {timeout} s: {state}")


@pytest.mark.parametrize("cluster", ["mooncake"], indirect=True)
def test_prefill_killed_mid_run(cluster: PDCluster) -> None:
    """Last on its cluster: it kills the prefill server and starts it again. Its scheduler
    is stopped while the requests arrive, so none of them is through its prefill when the
    kill comes (a kill signal ends a stopped process too)."""
    prompt = "Tell me everything about the history of the sea. " * 8

    def one(i: int) -> tuple[int | None, float]:
        tic = time.monotonic()
        body = {"text": f"{i} {prompt}", "sampling_params": {"max_new_tokens": 64}}
        try:
            r = requests.post(cluster.url + "/generate", json=body, timeout=60)
            code = r.status_code
        except requests.RequestException:
            code = None
        return code, time.monotonic() - tic

    info = requests.get(cluster.prefill.url + "/get_server_info", timeout=30).json()
    os.kill(info["internal_states"][0]["pid"], signal.SIGSTOP)
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(1.0)
        cluster.prefill.proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
        results = [f.result() for f in futures]
    assert all(elapsed < 30 for _, elapsed in results), results
    assert all(code != 200 for code, _ in results), results  # every in-flight request failed
    decode = cluster.decode.url
    assert requests.get(decode + "/health", timeout=10).status_code == 200
    state = wait_idle(decode)
    assert state["memory_integrity"]["ok"] is True, state
    # The dead prefill server never acknowledges the cancels of the requests that timed
    # out: their announced slots stay quarantined (counted as used) until the bound.
    deadline = time.monotonic() + 30
    while state["token_usage"] != 0.0 and time.monotonic() < deadline:
        time.sleep(0.5)
        state = wait_idle(decode)
    assert state["token_usage"] == 0.0, state
    assert state["memory_integrity"]["ok"] is True, state

    # A prefill server comes back on the same ports: PD traffic flows again and gives
    # the same tokens as an aggregated run on the decode server itself.
    cluster.prefill = cluster.start_prefill(port=cluster.prefill.port)
    expected = generate(decode, TEXTS[8], GREEDY)["output_ids"]
    deadline = time.monotonic() + 60
    while True:
        r = requests.post(
            cluster.url + "/generate",
            json={"text": TEXTS[8], "sampling_params": GREEDY},
            timeout=60,
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == expected
