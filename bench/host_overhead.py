"""Host overhead of a decode step: the real scheduler and model worker around a no-op model.

Each configuration (loop x batch) runs `bench/host_overhead_core.py` in a child process: a real
`ModelWorker` and `Scheduler` on CPU for a tiny Llama whose model is swapped for a no-op test
double, `batch` requests in steady decode, `scheduler.step()` timed wall clock. What remains is
the host's cost per step: planning, KV bookkeeping, batch and sampling inputs, the attention
backend's metadata, the argmax sampler, result processing, the overlap loop's thread handoff.

The "-gpu" loops (`normal-gpu`, `overlap-gpu`) run the GPU path's host work on this CPU
(`device_memory.StandInMemory`: a separate "device" copy of the request table and of every
staged input, the overlap loop without its thread), which is what a GPU's host pays per step;
trees without a GPU path on a CPU show "—".

"Before" runs the same core against a detached `git worktree` of `--ref` (the child gets that
tree on PYTHONPATH, so it imports the old code); "after" runs it against this repository. The
two sides alternate (ABAB) so the machine's drift hits both.

    python -m bench.host_overhead --repeat 3 --out host.md --json host.json
    python -m bench.host_overhead --no-ref --profile prof.txt   # this tree only, plus cProfile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.host_overhead_core import Config

CORE = Path(__file__).resolve().with_name("host_overhead_core.py")
REPO = CORE.parents[1]
DEFAULT_REF = "014fc99"  # the tree before the staged decode step
CPU_FLAGS = ("avx2", "avx512_bf16", "amx_bf16")


def run_child(tree: Path, cfg: Config, timeout_s: float) -> dict[str, Any]:
    """The core's `measure(cfg)` in a child process that imports `tree`'s code. `-P` keeps
    bench/ off sys.path (bench/datasets.py would shadow the `datasets` package)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-P", str(CORE), json.dumps(asdict(cfg)), result_path]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, check=False, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            raise RuntimeError(f"child {cfg} in {tree} failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(result_path).read_text())
    finally:
        Path(result_path).unlink(missing_ok=True)


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(
            ["lscpu"], check=False, capture_output=True, text=True
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "flags": {name: name in flags for name in CPU_FLAGS},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    if any("unsupported" in run for run in runs):
        return None  # the GPU path on a CPU, asked of a tree that has none
    us = sorted(x for run in runs for x in run["samples_us"])
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))]}


def table(rows: list[dict[str, Any]], with_before: bool) -> str:
    if not with_before:
        lines = ["| loop | batch | µs/step median | p90 |", "|---|---:|---:|---:|"]
        for r in rows:
            a = r["after"]
            lines.append(
                f"| {r['loop']} | {r['batch']} | {a['median_us']:.0f} | {a['p90_us']:.0f} |"
            )
        return "\n".join(lines)
    lines = [
        "| loop | batch | before µs (p90) | after µs (p90) | after/before |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, a = r["before"], r["after"]
        if b is None:
            lines.append(
                f"| {r['loop']} | {r['batch']} | — | {a['median_us']:.0f} ({a['p90_us']:.0f}) | — |"
            )
            continue
        lines.append(
            f"| {r['loop']} | {r['batch']} | {b['median_us']:.0f} ({b['p90_us']:.0f}) | "
            f"{a['median_us']:.0f} ({a['p90_us']:.0f}) | {a['median_us'] / b['median_us']:.2f} |"
        )
    return "\n".join(lines)


def report(args: argparse.Namespace, record: dict[str, Any]) -> str:
    m = record["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    head = [
        f"# Host overhead per decode step ({record['date']})",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores; {flags}",
        f"- torch {record['torch_version']}, {record['torch_threads']} threads (torch's default, "
        + "as the server's on CPU)",
        f"- before: {record['before_ref'] or '(not run)'}; after: {record['after_ref']}",
        f"- {args.steps} timed steps after {args.warmup} warm-up steps, repeat {args.repeat}, "
        + f"stream {'off' if args.no_stream else 'on'}; median and p90 over all timed steps",
        f"- command: `{record['command']}`",
        "",
        "",
    ]
    return "\n".join(head) + table(record["rows"], record["before_ref"] is not None) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ref", default=DEFAULT_REF, help="the 'before' commit (default %(default)s)")
    p.add_argument("--no-ref", action="store_true", help="run this tree only (no before)")
    p.add_argument(
        "--loops",
        nargs="+",
        default=["normal", "overlap", "normal-gpu", "overlap-gpu"],
        help="'-gpu': the GPU path's host work, run on this CPU (after only)",
    )
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    p.add_argument("--warmup", type=int, default=10, help="decode steps before timing")
    p.add_argument("--repeat", type=int, default=1, help="runs of each side per configuration")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--json", help="write the JSON record (every step's time) here")
    p.add_argument("--profile", help="cProfile the timed steps of this tree to this file")
    p.add_argument(
        "--profile-loop",
        default="normal",
        choices=["normal", "overlap", "normal-gpu", "overlap-gpu"],
    )
    p.add_argument("--profile-batch", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stream = not args.no_stream
    with tempfile.TemporaryDirectory(prefix="host-overhead-ref-") as tmp:
        before_tree: Path | None = None
        if not args.no_ref:
            before_tree = Path(tmp) / "tree"
            git("worktree", "add", "--detach", str(before_tree), args.ref)
        try:
            rows = []
            for loop in args.loops:
                for batch in args.batches:
                    cfg = Config(loop, batch, args.steps, args.warmup, stream)
                    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
                    for i in range(args.repeat):
                        sides = [("after", REPO)]
                        if before_tree is not None:
                            pair = [("before", before_tree), ("after", REPO)]
                            sides = pair if i % 2 == 0 else pair[::-1]
                        for name, tree in sides:
                            runs[name].append(run_child(tree, cfg, args.timeout))
                    row = {"loop": loop, "batch": batch, "runs": runs}
                    row.update({k: summarize(v) for k, v in runs.items() if v})
                    rows.append(row)
                    print(
                        f"{loop} batch {batch}: "
                        + ", ".join(
                            f"{k} {row[k]['median_us']:.0f} µs"
                            for k in ("before", "after")
                            if row.get(k) is not None
                        ),
                        file=sys.stderr,
                    )
            before_ref = None
            if before_tree is not None:
                before_ref = f"{args.ref} ({git('rev-parse', '--short', 'HEAD', cwd=before_tree)})"
        finally:
            if before_tree is not None:
                git("worktree", "remove", "--force", str(before_tree))
    if args.profile:
        cfg = Config(args.profile_loop, args.profile_batch, args.steps, args.warmup, stream)
        cfg.profile_path = str(Path(args.profile).resolve())
        run_child(REPO, cfg, args.timeout)
    first = rows[0]["runs"]["after"][0]
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "torch_version": first["torch_version"],
        "torch_threads": first["torch_threads"],
        "before_ref": before_ref,
        "after_ref": f"{git('rev-parse', '--short', 'HEAD')}{dirty}",
        "command": shlex.join(
            ["python", "-m", "bench.host_overhead", *(sys.argv[1:] if argv is None else argv)]
        ),
        "rows": rows,
    }
    text = report(args, record)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
