"""bench/ab.py starts both servers itself, runs one workload on each, and writes the
comparison and its plots. The servers run a tiny random model with the default model's
tokenizer: what is checked is the plumbing, which does not need a real model's speed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from bench import ab

pytestmark = pytest.mark.slow


def test_ab_radix_preset(tmp_path: Path, tiny_served_model: str) -> None:
    server_args = shlex.join(
        ["--model-path", tiny_served_model, "--dtype", "float32", "--max-total-tokens", "8192"]
    )
    record = ab.main(
        [
            "--preset", "radix",
            "--server-args", server_args,
            "--out-dir", str(tmp_path),
            "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", "2",
            "--gsp-prompts-per-group", "3",
            "--gsp-system-prompt-len", "96",
            "--gsp-question-len", "8",
            "--gsp-output-len", "8",
            "--max-concurrency", "3",
            "--disable-tqdm",
        ]
    )  # fmt: skip
    off, on = record["results"]["radix-off"], record["results"]["radix-on"]
    for res in (off, on):
        assert res["completed"] == 6 and res["failed"] == 0
        assert res["total_output_tokens"] == 6 * 8 and len(res["ttfts_s"]) == 6
    assert off["prefix_cache_hit_rate"] == 0.0 and on["prefix_cache_hit_rate"] > 0.3
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert {r["metric"] for r in saved["ratios"]} >= {"duration", "mean_ttft_ms"}
    for png in ("ttft_cdf.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "server-radix-on.log").exists()


@pytest.mark.parametrize("flag", ["--backend", "--backend=openai"])
def test_bench_serving_flags_pass_through_unabbreviated(flag: str) -> None:
    """`--backend` is bench_serving's, not an abbreviation of ab's --backend-a/--backend-b."""
    args = [flag, "openai"] if "=" not in flag else [flag]
    ab_args, rest = ab.build_ab_parser().parse_known_args(["--preset", "vllm", *args])
    assert ab_args.backend_a is None and ab_args.backend_b is None
    assert rest == args
