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
    header += " grammars | RSS MB (main / children) | fds | threads |"
    lines = [header, "|---" * 10 + "|"]
    for row in record["samples"]:
        procs = row["processes"].values()
        rss = " / ".join(f"{p['rss_mb']:.0f}" for p in procs)
        fds = " / ".join(str(p["fds"]) for p in procs)
        threads = " / ".join(str(p["threads"]) for p in procs)
        tt, tp = row["ttft"], row["tpot"]
        lines.append(
            f"| {row['t']:.0f} | {row['finished']} | {row['failed']} | {_fmt(tt['p50'])} / "
            f"{_fmt(tt['p99'])} | {_fmt(tp['p50'], 1e3)} / {_fmt(tp['p99'], 1e3)} | "
            f"{row['server']['token_usage']:.3f} | {row['server']['grammar_cache']} | {rss} | "
            f"{fds} | {threads} |"
        )
    verdict = record["memory_integrity"]
    refused, failed = record["expected_refusals"], len(record["failures"])
    lines.append(f"\nRequests: {record['requests']}, expected refusals {refused}, failed {failed}.")
    lines.append(f"Memory integrity when idle: {verdict}.")
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    plot(record, out / "soak.png")


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
