"""bench_serving against a real RadixRT server: a tiny shared-prefix workload, native and
OpenAI backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_serving import build_parser, run_benchmark
from tests.server.server_process import ServerProcess

GSP = [
    "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
    "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
    "--gsp-question-len", "8", "--gsp-output-len", "8", "--max-concurrency", "4",
    "--flush-cache", "--disable-tqdm",
]  # fmt: skip


@pytest.mark.slow
def test_gsp_workload_on_real_server(tmp_path: Path) -> None:
    srv = ServerProcess("--max-total-tokens", "8192", log_path=tmp_path / "server.log")
    try:
        results = {}
        for backend in ("radixrt", "openai"):
            args = build_parser().parse_args(["--backend", backend, "--base-url", srv.url, *GSP])
            results[backend] = run_benchmark(args)
    finally:
        srv.stop()
    for backend, m in results.items():
        assert (m["completed"], m["failed"]) == (6, 0), (backend, m["errors"], srv.tail())
        assert m["total_output_tokens"] == 6 * 8, backend
        assert m["mean_ttft_ms"] > 0 and m["mean_itl_ms"] > 0, backend
    assert results["radixrt"]["total_input_tokens"] == 6 * 72
    assert results["radixrt"]["prefix_cache_hit_rate"] > 0.3, results["radixrt"]
