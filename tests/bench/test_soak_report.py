"""bench/soak_report.py's checks, the soak's criteria, on synthetic records: a flat run
passes every one, and each kind of drift or failure is caught."""

from __future__ import annotations

import copy
from typing import Any

from bench.soak_report import checks


def record() -> dict[str, Any]:
    def sample(t: float, rss: float) -> dict[str, Any]:
        procs = {"main": {"rss_mb": 140.0, "fds": 30, "threads": 11}}
        procs["child 2"] = {"rss_mb": rss, "fds": 60, "threads": 20}
        return {"t": t, "processes": procs}

    streams = [(t, 0.2 if t % 50 else 1.0, 0.04) for t in range(1, 1800)]
    return {
        "samples": [sample(t, r) for t, r in ((60, 900), (600, 2000), (1200, 2010), (1800, 2020))],
        "streams": streams,
        "memory_integrity": {"ok": True, "token_usage_idle": 0.0},
        "failures": [],
    }


def verdicts(rec: dict[str, Any]) -> dict[str, bool]:
    return {name: ok for name, _, ok in checks(rec)}


def test_a_flat_run_passes_every_check() -> None:
    out = verdicts(record())
    assert all(out.values()), out
    assert any(name.startswith("TTFT p99") for name in out)


def test_each_drift_and_failure_is_caught() -> None:
    leak = record()
    leak["samples"][-1]["processes"]["child 2"]["rss_mb"] = 2000 * 1.06
    assert not verdicts(leak)["RSS of child 2 after 600 s"]

    busy = record()  # a peak of open connections is not a leak
    busy["samples"][2]["processes"]["main"]["fds"] = 60
    assert verdicts(busy)["least fds of main, last 600 s / after 600 s"]

    fds = record()
    for sample in fds["samples"][2:]:
        sample["processes"]["main"]["fds"] = 31
    assert not verdicts(fds)["least fds of main, last 600 s / after 600 s"]

    slow = copy.deepcopy(record())
    slow["streams"] = [(t, 0.5 if t > 1200 else 0.2, 0.04) for t, _, _ in slow["streams"]]
    assert not verdicts(slow)["TTFT p99, last 600 s / first"]

    lost = record()
    lost["memory_integrity"] = {"ok": True, "token_usage_idle": 0.01}
    assert not verdicts(lost)["idle KV usage and integrity"]

    error = record()
    error["failures"] = [{"kind": "chat_stream", "status": "http 500"}]
    out = verdicts(error)
    assert not out["5xx besides overload 503s"] and not out["failed requests"]
