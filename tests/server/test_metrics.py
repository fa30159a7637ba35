"""`/metrics` exposes SGLang's and vLLM's names, and the values move under load."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

NAMES = [
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:gen_throughput",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_retracted_requests_total",
    "sglang:time_to_first_token_seconds_count",
    "sglang:inter_token_latency_seconds_count",
    "sglang:e2e_request_latency_seconds_count",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "radixrt:worker_idle_seconds_total",
    "radixrt:worker_busy_seconds_total",
    "radixrt:worker_idle_fraction",
    "sglang:cached_tokens_total",
    "sglang:num_used_tokens",
    "radixrt:num_queued_tokens",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]


def scrape(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_names_and_movement(url: str) -> None:
    before = scrape(url)
    missing = [n for n in NAMES if n not in before]
    assert not missing, missing

    peak = {"running": 0.0, "usage": 0.0, "throughput": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            now = scrape(url)
            peak["running"] = max(peak["running"], now["vllm:num_requests_running"])
            peak["usage"] = max(peak["usage"], now["sglang:token_usage"])
            peak["throughput"] = max(peak["throughput"], now["sglang:gen_throughput"])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {
        "text": [f"Story {i}: once upon a time" for i in range(8)],
        "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
        "stream": True,
    }
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        for _ in r.iter_lines():
            pass
    time.sleep(1.5)  # the scheduler reports its idle state at least once a second
    stop.set()
    watcher.join()
    after = scrape(url)

    assert (
        after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 8 * 48
    )
    assert after["sglang:prompt_tokens_total"] > before["sglang:prompt_tokens_total"]
    assert (
        after["sglang:time_to_first_token_seconds_count"]
        - before["sglang:time_to_first_token_seconds_count"]
        == 8
    )
    assert (
        after["sglang:inter_token_latency_seconds_count"]
        - before["sglang:inter_token_latency_seconds_count"]
        == 8 * 47
    )
    assert (
        after["sglang:e2e_request_latency_seconds_count"]
        - before["sglang:e2e_request_latency_seconds_count"]
        == 8
    )
    busy = after["radixrt:worker_busy_seconds_total"] - before["radixrt:worker_busy_seconds_total"]
    assert busy > 0
    assert 0 <= after["radixrt:worker_idle_fraction"] < 1
    assert peak["running"] >= 1 and peak["usage"] > 0 and peak["throughput"] > 0
    assert after["vllm:num_requests_running"] == 0 and after["sglang:num_running_reqs"] == 0


def test_prefix_cache_counters(url: str) -> None:
    """Two requests sharing a long prefix, one after the other: the second is served partly
    from the prefix cache, and the token counters move by exactly what `meta_info` reports."""
    prefix = f"Shared prefix {time.monotonic_ns()}: " + "the sea was calm and grey. " * 20
    before = scrape(url)
    metas = []
    for tail in ("First question?", "Second question?"):
        body = {"text": prefix + tail, "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metas.append(r.json()["meta_info"])
    after = scrape(url)

    def moved(name: str) -> float:
        return after[name] - before[name]

    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    assert metas[1]["cached_tokens"] >= 100, metas  # the shared prefix came from the cache
    assert moved("sglang:cached_tokens_total") == cached
    assert moved("vllm:prefix_cache_hits_total") == cached
    assert moved("vllm:prefix_cache_queries_total") == prompt
    assert moved("sglang:prompt_tokens_total") == prompt
