"""`bench.front_capacity`'s plumbing: the real front process (HTTP server and tokenizer
manager) streams every token of the stand-in scheduler to `bench_serving`, and the report
names both processes' CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_every_stand_in_token_reaches_the_client(tiny_served_model: str) -> None:
    cmd = [
        sys.executable, "-m", "bench.front_capacity", "--model-path", tiny_served_model,
        "--port", str(free_port()), "--num-prompts", "6", "--input-len", "16",
        "--output-len", "12", "--step-ms", "2",
    ]  # fmt: skip
    # It exits 1 unless 6 x 12 tokens arrived.
    run = subprocess.run(cmd, cwd=REPO, check=True, timeout=240, capture_output=True, text=True)
    assert "6 streams x 12 tokens" in run.stdout, run.stdout
    for name in ("front", "client"):
        row = rf"^{name}\s+[\d.]+ CPU s/s\s+[\d.]+ µs/token"
        assert re.search(row, run.stdout, re.MULTILINE), run.stdout
