"""bench/soak.py checks its own plumbing against the session's server: a few seconds of every
kind of request, per-interval samples of each server process, and the idle integrity
verdict; a run with a failed request or a lost KV slot exits non-zero."""

from __future__ import annotations

import json

import pytest

from bench import soak


@pytest.mark.slow
def test_short_soak_on_the_session_server(server, tmp_path) -> None:
    out = tmp_path / "soak"
    # A count of arrivals, not a duration, so that a loaded machine sends the same traffic.
    # Their Poisson gaps add up to seconds, far over the interval, so the loop samples at
    # least once before the last sample, which follows the traffic.
    argv = ["--url", server.url, "--pid", str(server.proc.pid), "--requests", "20"]
    argv += ["--interval-s", "0.5", "--rate", "8", "--seed", "3", "--out", str(out)]
    argv += ["--max-new-tokens", "16"]  # the plumbing, not the pace: short outputs
    soak.main(argv)  # SystemExit(1) on any failed request or integrity verdict but ok
    record = json.loads((out / "soak.json").read_text())
    assert record["requests"] >= 20 and record["failures"] == []
    assert record["memory_integrity"]["ok"] is True
    assert record["memory_integrity"]["token_usage_idle"] == 0.0
    assert len(record["samples"]) >= 2
    last = record["samples"][-1]
    assert {"main"} < set(last["processes"]), last["processes"]  # main and its children
    assert all(p["rss_mb"] > 0 and p["fds"] > 0 for p in last["processes"].values())
    assert last["server"]["grammar_cache"] > 0  # the schema and regex kinds compiled some
    assert (out / "soak.md").exists() and (out / "soak.png").stat().st_size > 0
    assert len(record["by_kind"]) >= 6, record["by_kind"]  # a mix, not one kind
