"""The benchmark client against `FakeStreamingServer`: timings, token counts, cached-token hit
rate, failure counting, concurrency and the CLI path, all without a model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from bench.bench_serving import benchmark, build_parser, run_benchmark, summarize
from bench.datasets import DatasetRow
from bench.serving_backends import BACKENDS, RequestResult, send_request
from tests.bench.fake_server import FakeStreamingServer, Script

# A loaded 2-core machine can deliver a chunk late, which lengthens the gap before it and
# shortens the one after: single gaps have no lower bound. What holds whatever the load: the
# first chunk never arrives before the server's first delay, the last never before all its
# sleeps, and the client's arithmetic (a 2-token chunk is two equal gaps; TTFT plus the gaps
# is the time of the last chunk). Upper bounds only catch a client that waits for nothing.
SLACK = 2.0


class WordTokenizer:
    """Counts words: enough for the client's fallback when a server reports no counts."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


def one_request(url: str, backend: str, prompt: str, tokenizer: object = None) -> RequestResult:
    async def go() -> RequestResult:
        api = BACKENDS[backend]
        async with aiohttp.ClientSession() as session:
            row = DatasetRow(prompt, prompt_len=7, output_len=4)
            return await send_request(session, api, url + api.path, row, "m", tokenizer)

    return asyncio.run(go())


def run(url: str, backend: str, prompts: list[str], **kwargs: object) -> dict:
    rows = [DatasetRow(p, prompt_len=7, output_len=4) for p in prompts]
    kwargs.setdefault("warmup_requests", 0)
    return asyncio.run(benchmark(backend, url, rows, model="m", **kwargs))  # type: ignore[arg-type]


def assert_timings(r: RequestResult, first_delay: float, sleeps: float) -> None:
    """Bounds that hold on a loaded machine (see SLACK)."""
    assert first_delay <= r.ttft < first_delay + SLACK
    assert all(x > 0 for x in r.itl)
    last_chunk = r.ttft + sum(r.itl)
    assert sleeps <= last_chunk <= r.latency < sleeps + SLACK


def test_native_ttft_itl_and_counts() -> None:
    script = Script(chunks=[1, 2, 1], first_delay=0.2, gap=0.1, prompt_tokens=40, cached_tokens=30)
    with FakeStreamingServer({"p": script}) as srv:
        r = one_request(srv.url, "radixrt", "p")
    assert r.success, r.error
    assert_timings(r, first_delay=0.2, sleeps=0.4)
    # The 2-token chunk after a 0.1 s gap counts as two equal gaps.
    assert len(r.itl) == 3 and r.itl[0] == r.itl[1]
    assert (r.prompt_len, r.output_len, r.cached_tokens) == (40, 4, 30)
    assert r.text == "tok " * 4


def test_native_without_counts_uses_output_ids() -> None:
    script = Script(chunks=[2, 3], report_counts=False)
    with FakeStreamingServer({"p": script}) as srv:
        r = one_request(srv.url, "sglang", "p")
    assert r.success, r.error
    assert (r.prompt_len, r.output_len, len(r.itl)) == (7, 5, 3)


@pytest.mark.parametrize("backend", ["openai", "vllm", "openai-chat"])
def test_openai_chunks_and_usage(backend: str) -> None:
    script = Script(chunks=[1, 1, 1], first_delay=0.1, gap=0.05, prompt_tokens=9, cached_tokens=4)
    with FakeStreamingServer({"p": script}) as srv:
        r = one_request(srv.url, backend, "p")
    assert r.success, r.error
    assert_timings(r, first_delay=0.1, sleeps=0.2)
    assert len(r.itl) == 2
    assert (r.prompt_len, r.output_len, r.cached_tokens) == (9, 3, 4)


def test_openai_without_usage_tokenizes_the_text() -> None:
    with FakeStreamingServer({"p": Script(chunks=[2, 1], report_counts=False)}) as srv:
        r = one_request(srv.url, "openai", "p", tokenizer=WordTokenizer())
    assert r.success, r.error
    assert (r.prompt_len, r.output_len, len(r.itl)) == (7, 3, 1)


@pytest.mark.parametrize("backend", ["radixrt", "openai"])
def test_failures_are_counted_not_raised(backend: str) -> None:
    scripts = {f: Script(chunks=[1, 1, 1], fail=f) for f in ("http", "event", "drop")}
    with FakeStreamingServer(scripts) as srv:
        m = run(srv.url, backend, ["http", "event", "drop", "ok"])
    assert (m["completed"], m["failed"]) == (1, 3)
    assert len(m["errors"]) == 3  # the dropped connection is an error of its own
    errors = " | ".join(m["errors"])
    assert "HTTP 503" in errors and "scripted failure" in errors
    assert m["total_output_tokens"] == 3


def test_summary_hit_rate_and_concurrency() -> None:
    scripts = {f"p{i}": Script(prompt_tokens=100, cached_tokens=25 * i, gap=0.02) for i in range(4)}
    with FakeStreamingServer(scripts) as srv:
        m = run(srv.url, "radixrt", list(scripts) * 2, max_concurrency=2)
        peak = srv.peak_in_flight
    assert peak == 2
    assert (m["completed"], m["failed"], m["total_input_tokens"]) == (8, 0, 800)
    assert m["total_output_tokens"] == 24
    assert m["prefix_cache_hit_rate"] == pytest.approx(300 / 800)
    assert m["max_concurrency"] == 2


def test_warmup_is_not_counted_and_flush_comes_after_it() -> None:
    with FakeStreamingServer() as srv:
        m = run(srv.url, "radixrt", ["a", "b"], warmup_requests=2, flush_cache=True)
        log = list(srv.log)
    assert m["completed"] == 2
    assert log[:3] == [("request", "a"), ("request", "a"), ("flush",)]
    assert sorted(log[3:]) == [("request", "a"), ("request", "b")]


def test_poisson_arrivals_take_their_time() -> None:
    with FakeStreamingServer() as srv:
        m = run(srv.url, "openai", ["a"] * 4, request_rate=20.0, seed=3)
    gaps = np.random.default_rng(3).exponential(1 / 20.0, size=3)
    assert m["duration"] >= gaps.sum()
    assert m["request_rate"] == 20.0


def test_summarize_metric_math() -> None:
    a = RequestResult(True, "", 10, 5, ttft=0.1, itl=[0.1, 0.1, 0.2, 0.2], latency=0.7)
    b = RequestResult(True, "", 30, 1, ttft=0.3, itl=[], latency=0.3, cached_tokens=20)
    bad = RequestResult(False, "boom", 50)
    m = summarize([a, b, bad], duration=2.0)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, {"boom": 1})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(20.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_throughput"] == pytest.approx(23.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(500.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT only for requests with more than one output token: (0.7 - 0.1) / 4.
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(150.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([100, 100, 200, 200], 99))
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.5)


def test_cli_run_benchmark_with_server_tokenizer(
    default_model_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.jsonl"
    with FakeStreamingServer(tokenizer_path=default_model_path) as srv:
        argv = ["--backend", "openai-chat", "--base-url", srv.url, "--dataset-name", "random"]
        argv += ["--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "3"]
        argv += ["--random-range-ratio", "1", "--output-file", str(out), "--disable-tqdm"]
        metrics = run_benchmark(build_parser().parse_args(argv))
    assert metrics["completed"] == 3 and metrics["failed"] == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["backend"] == "openai-chat" and record["request_rate"] == "inf"
    assert record["completed"] == 3 and "mean_ttft_ms" in record
