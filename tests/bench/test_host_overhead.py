"""`bench.host_overhead` on this tree only: the measurement core times steady decode steps of
the real scheduler and worker around its no-op model (both loops), and the CLI runs it in a
child process and writes its report and JSON record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.host_overhead import main
from bench.host_overhead_core import Config, measure


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_core_times_steady_decode_steps(loop: str) -> None:
    # measure() itself checks that every timed forward decoded the whole batch and that each
    # step streamed one token per request.
    result = measure(Config(loop, batch=2, steps=8, warmup=2))
    assert len(result["samples_us"]) == 8
    assert all(t > 0 for t in result["samples_us"])
    assert 0 < result["median_us"] <= result["p90_us"]
    assert result["torch_threads"] >= 1


def test_cli_runs_a_child_and_writes_report(tmp_path: Path) -> None:
    out, record_path = tmp_path / "host.md", tmp_path / "host.json"
    argv = ["--no-ref", "--loops", "normal", "--batches", "2", "--steps", "5", "--warmup", "1"]
    main([*argv, "--out", str(out), "--json", str(record_path)])
    record = json.loads(record_path.read_text())
    [row] = record["rows"]
    assert (row["loop"], row["batch"], "before" in row) == ("normal", 2, False)
    assert row["after"]["median_us"] > 0
    assert record["before_ref"] is None
    assert "| normal | 2 |" in out.read_text()
