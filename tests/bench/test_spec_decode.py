"""`bench.spec_decode`'s plumbing on a tiny random Llama (with the default model's tokenizer,
for the copy workload's chat template): every workload, concurrency and algorithm reported,
and speculation's tokens equal plain decoding's, greedy and seeded-sampled alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_cli_reports_each_workload_and_algorithm(tmp_path: Path, tiny_served_model: str) -> None:
    out = tmp_path / "spec.json"
    cmd = [
        sys.executable, "-m", "bench.spec_decode", "--model-path", tiny_served_model,
        "--dtype", "float32", "--workload", "copy", "w1-sampled", "--concurrency", "2",
        "--max-prompts", "3", "--w1-prompts", "3", "--max-new-tokens", "24", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())
    keys = {(r["workload"], r["concurrency"], r["speculation"]) for r in rows}
    assert keys == {(w, 2, s) for w in ("copy", "w1-sampled") for s in ("off", "ngram", "suffix")}
    for row in rows:
        assert row["same_tokens_as_off"] is True, row
        assert row["output_tok_s"] > 0, row
        if row["speculation"] == "off":
            assert row["vs_off"] == 1.0 and row["accept_length"] is None, row
        else:
            # 0.0: no request drafted (a random model rarely repeats); else at least one
            # token per verify step
            assert row["accept_length"] == 0.0 or row["accept_length"] >= 1.0, row
