"""`bench/soak.py`'s report: the per-interval table (`soak.md`), the record (`soak.json`) and
each series over time (`soak.png`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(record: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(record, indent=1))
    header = "| t (s) | finished | failed | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | KV usage |"
    header += " grammars | RSS MB (main / children) | fds | threads | compile procs (n, MB) |"
    lines = [header, "|---" * 11 + "|"]
    for row in record["samples"]:
        procs = row["processes"].values()
        rss = " / ".join(f"{p['rss_mb']:.0f}" for p in procs)
        fds = " / ".join(str(p["fds"]) for p in procs)
        threads = " / ".join(str(p["threads"]) for p in procs)
        tt, tp = row["ttft"], row["tpot"]
        grammar = row.get("grammar_processes") or {"count": 0, "rss_mb": 0}
        lines.append(
            f"| {row['t']:.0f} | {row['finished']} | {row['failed']} | {_fmt(tt['p50'])} / "
            f"{_fmt(tt['p99'])} | {_fmt(tp['p50'], 1e3)} / {_fmt(tp['p99'], 1e3)} | "
            f"{row['server']['token_usage']:.3f} | {row['server']['grammar_cache']} | {rss} | "
            f"{fds} | {threads} | {grammar['count']}, {grammar['rss_mb']:.0f} |"
        )
    verdict = record["memory_integrity"]
    refused, failed = record["expected_refusals"], len(record["failures"])
    lines.append(f"\nRequests: {record['requests']}, expected refusals {refused}, failed {failed}.")
    lines.append(f"Memory integrity when idle: {verdict}.")
    lines.append("\n| check | measured | verdict |\n|---|---|---|")
    for name, measured, ok in checks(record):
        lines.append(f"| {name} | {measured} | {'ok' if ok else 'FAILED'} |")
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    plot(record, out / "soak.png")


# The soak's criteria: growth is judged after the first `WARM_S`, latency compares the first
# and the last `WINDOW_S` of traffic.
WARM_S = 600.0
WINDOW_S = 600.0
MAX_RSS_GROWTH = 0.05
MAX_TTFT_P99_RATIO = 1.2


def checks(record: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(check, what was measured, passed) for each criterion of a soak run."""
    out = []
    rows = record["samples"]
    warm = next((r for r in rows if r["t"] >= WARM_S), rows[0])
    last = rows[-1]
    for name in sorted(warm["processes"]):
        if name not in last["processes"]:
            continue
        a, b = warm["processes"][name], last["processes"][name]
        growth = b["rss_mb"] / a["rss_mb"] - 1
        out.append(
            (
                f"RSS of {name} after {WARM_S:.0f} s",
                f"{a['rss_mb']:.0f} → {b['rss_mb']:.0f} MB ({growth:+.1%})",
                growth < MAX_RSS_GROWTH,
            )
        )
        # Open connections and their threads come and go with the traffic; a leak raises
        # the floor. So the floor of the last window is held to that of the first.
        first = _window(rows, name, warm["t"], warm["t"] + WINDOW_S)
        final = _window(rows, name, last["t"] - WINDOW_S, last["t"] + 1)
        for metric in ("fds", "threads"):
            a_min, b_min = min(p[metric] for p in first), min(p[metric] for p in final)
            out.append(
                (
                    f"least {metric} of {name}, last {WINDOW_S:.0f} s / after {WARM_S:.0f} s",
                    f"{b_min} / {a_min}",
                    b_min <= a_min,
                )
            )
    check = record["memory_integrity"]
    out.append(
        (
            "idle KV usage and integrity",
            f"usage {check.get('token_usage_idle')}, ok {check.get('ok')}",
            check.get("ok") is True and check.get("token_usage_idle") == 0,
        )
    )
    end = max((s[0] for s in record.get("streams", [])), default=0.0)
    first = [s[1] for s in record.get("streams", []) if s[0] <= WINDOW_S]
    final = [s[1] for s in record.get("streams", []) if s[0] > end - WINDOW_S]
    if first and final and end >= 2 * WINDOW_S:
        p_first, p_final = _p99(first), _p99(final)
        ratio = p_final / p_first
        out.append(
            (
                f"TTFT p99, last {WINDOW_S:.0f} s / first",
                f"{p_final:.3g} s / {p_first:.3g} s = {ratio:.2f}",
                ratio <= MAX_TTFT_P99_RATIO,
            )
        )
    server_errors = [f for f in record["failures"] if f["status"].startswith("http 5")]
    out.append(("5xx besides overload 503s", str(len(server_errors)), not server_errors))
    out.append(("failed requests", str(len(record["failures"])), not record["failures"]))
    return out


def _window(rows: list[dict[str, Any]], name: str, start: float, end: float) -> list[dict]:
    return [r["processes"][name] for r in rows if start <= r["t"] < end and name in r["processes"]]


def _p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.3g}"


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["samples"]
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    names = sorted({n for r in rows for n in r["processes"]})
    for metric, ax in zip(("rss_mb", "fds", "threads"), axes[0], strict=True):
        for name in names:
            ax.plot(t, [r["processes"].get(name, {}).get(metric) for r in rows], label=name)
        ax.set_title(metric)
    grammar = [r.get("grammar_processes") or {"rss_mb": 0} for r in rows]
    axes[0][0].plot(t, [g["rss_mb"] for g in grammar], label="grammar compile processes")
    axes[0][0].legend(fontsize=6)
    axes[1][0].plot(t, [r["server"]["token_usage"] for r in rows], label="KV token usage")
    cache = [r["server"]["grammar_cache"] for r in rows]
    axes[1][0].plot(t, [c / max(max(cache), 1) for c in cache], label="grammar cache / max")
    axes[1][0].set_title("KV usage, grammar cache")
    axes[1][0].legend(fontsize=6)
    for key, ax in (("ttft", axes[1][1]), ("tpot", axes[1][2])):
        for p in ("p50", "p99"):
            ax.plot(t, [r[key][p] for r in rows], label=p)
        ax.set_title(f"{key} (s)")
        ax.legend()
    for ax in axes.flat:
        ax.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
