"""bench_serving against a real RadixRT server (the session's shared one): a tiny
shared-prefix workload, native and OpenAI backends."""

from __future__ import annotations

import pytest

from bench.bench_serving import build_parser, run_benchmark

GSP = [
    "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
    "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
    "--gsp-question-len", "8", "--gsp-output-len", "8", "--max-concurrency", "4",
    "--flush-cache", "--disable-tqdm",
]  # fmt: skip


@pytest.mark.slow
def test_gsp_workload_on_real_server(server) -> None:
    results = {}
    for backend in ("radixrt", "openai"):
        args = build_parser().parse_args(["--backend", backend, "--base-url", server.url, *GSP])
        results[backend] = run_benchmark(args)  # --flush-cache: no prefix from other tests
    for backend, m in results.items():
        assert (m["completed"], m["failed"]) == (6, 0), (backend, m["errors"], server.tail())
        assert m["total_output_tokens"] == 6 * 8, backend
        assert m["mean_ttft_ms"] > 0 and m["mean_itl_ms"] > 0, backend
        assert m["client_cpu_s"] > 0, backend  # bench.serving_cpu reads it
    assert results["radixrt"]["total_input_tokens"] == 6 * 72
    assert results["radixrt"]["prefix_cache_hit_rate"] > 0.3, results["radixrt"]
