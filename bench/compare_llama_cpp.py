"""RadixRT against llama.cpp's `llama-server` on the GGUF file we ship, side by side in one run.

    bash bench/peers/build_llama_cpp.sh ~/llama.cpp        # once (~20 min on 2 cores)
    python -m bench.compare_llama_cpp --llama-server ~/llama.cpp/build/bin/llama-server

Engines: RadixRT with the file's weights kept quantized (`--quantization gguf`), RadixRT in
float32 (`--quantization none`), llama.cpp on the same file (2 threads, 16 slots). Each
engine gets the two workloads through `bench.bench_serving` (OpenAI completions, prompts from
the same tokenizer):

- C1, one user at a time: 8 prompts of 256 random tokens, 128 out, concurrency 1. Output tok/s,
  TTFT, TPOT. Beside them: the weight bytes a decode step streams (RadixRT: its start-up
  log's `Weights:` line; llama.cpp: the file's tensor bytes), and that rate (bytes / TPOT) as a
  share of the machine's memory bandwidth, measured here (`memory_bandwidth_gbs`: the faster
  of two 1 GiB reads with 2 threads).
- W2, shared prefixes at concurrency 16 (bench.compare_vllm's W2): duration and throughput.

`--tries N` runs every engine N times, the order reversed on odd tries; the median try counts.
Writes `--out-dir/compare_llama_cpp.json` and prints a table with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.bench_serving import build_parser, run_benchmark
from bench.compare_vllm import W2, cpu_header
from bench.launch import free_port, start_radixrt, stop, wait_healthy

C1 = [
    "--backend", "openai", "--dataset-name", "random", "--num-prompts", "8",
    "--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "1",
    "--max-concurrency", "1", "--seed", "1", "--disable-tqdm",
]  # fmt: skip
WORKLOADS = {"c1": C1, "w2": W2}


def memory_bandwidth_gbs(threads: int = 2) -> dict[str, float]:
    """Read bandwidth with `threads` threads, the best of 5 passes over 1 GiB: torch summing a
    float32 array (`sum`), and the float32 panel kernel multiplying one row by a 1 GiB weight
    (`panels`: the prefetched stream a decode step reads its weights with, which reaches more).
    """
    import torch

    from srt.kernels.linear import packed_linear_kernel

    torch.set_num_threads(threads)

    def best(fn: Any, nbytes: int) -> float:
        seconds = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn()
            seconds = min(seconds, time.perf_counter() - start)
        return round(nbytes / seconds / 1e9, 2)

    x = torch.ones(1 << 28)
    rates = {"sum": best(x.sum, x.nbytes)}
    kernel = packed_linear_kernel()
    if kernel is not None:
        panels = kernel.pack(torch.full((1 << 18, 1024), 0.01))
        row = torch.ones(1, 1024)
        rates["panels"] = best(lambda: kernel(row, panels, 1 << 18), panels.nbytes)
    return rates


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's tensors: what llama.cpp reads per decode step (a tied embedding is
    its output matrix too; only the looked-up rows of it are read as the embedding)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def radixrt_weight_bytes(log: Path) -> int | None:
    """The weight bytes RadixRT reported at start-up, if it did."""
    match = re.search(r"Weights: ([0-9.]+) MB", log.read_text())
    return None if match is None else int(float(match.group(1)) * 1e6)


def start_llama_server(binary: str, gguf: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--port", str(port), "-t", "2", "-np", "16", "-c", "16384"]
    out = open(log, "w")  # noqa: SIM115 (the process writes it until stopped)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(proc, url, 300):
        stop(proc)
        raise SystemExit(f"llama-server did not start; see {log}")
    return proc, url


def run_workload(url: str, workload: str, tokenizer: str) -> dict[str, Any]:
    args = build_parser().parse_args(
        [*WORKLOADS[workload], "--base-url", url, "--tokenizer", tokenizer]
    )
    result = run_benchmark(args)
    keep = ("duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms")
    return {k: result[k] for k in keep if k in result} | {"completed": result.get("completed")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from srt.model_loader.default_model import find_default_gguf
    from srt.model_loader.sources import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--tries", type=int, default=1)
    p.add_argument("--workloads", default="c1,w2")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results/compare_llama_cpp"))
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gguf = find_default_gguf()
    tokenizer = resolve_model_path(None)
    engines = {
        "radixrt-q4_1": ["--quantization", "gguf", "--dtype", "float32"],
        "radixrt-float32": ["--quantization", "none", "--dtype", "float32"],
        "llama.cpp-q4_1": None,
    }
    report: dict[str, Any] = {"cpu": cpu_header(), "model": gguf.name}
    report["bandwidth_measured_gbs"] = memory_bandwidth_gbs()
    report["bandwidth_gbs"] = max(report["bandwidth_measured_gbs"].values())
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {e: {} for e in engines}
    step_bytes: dict[str, int | None] = {"llama.cpp-q4_1": gguf_tensor_bytes(gguf)}
    for t in range(args.tries):
        order = list(engines) if t % 2 == 0 else list(reversed(engines))
        for name in order:
            log = args.out_dir / f"{name}-{t}.log"
            if engines[name] is None:
                proc, url = start_llama_server(args.llama_server, gguf, log)
            else:
                proc, url = start_radixrt(engines[name], log)
            try:
                for workload in args.workloads.split(","):
                    result = run_workload(url, workload, tokenizer)
                    runs[name].setdefault(workload, []).append(result)
                    print(name, workload, result, flush=True)
            finally:
                stop(proc)
            if engines[name] is not None:
                step_bytes[name] = radixrt_weight_bytes(log)
    report["engines"] = {}
    for name, by_workload in runs.items():
        entry: dict[str, Any] = {"weight_bytes": step_bytes.get(name)}
        for workload, results in by_workload.items():
            key = "duration"
            median = sorted(results, key=lambda r: r[key])[(len(results) - 1) // 2]
            entry[workload] = {**median, "tries_duration": [r[key] for r in results]}
        c1 = entry.get("c1")
        if c1 and entry["weight_bytes"] and c1.get("mean_tpot_ms"):
            rate = entry["weight_bytes"] / (c1["mean_tpot_ms"] / 1e3) / 1e9
            entry["c1_weight_gbs"] = round(rate, 2)
            entry["c1_bandwidth_share"] = round(rate / report["bandwidth_gbs"], 3)
        report["engines"][name] = entry
    print(table(report))
    (args.out_dir / "compare_llama_cpp.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        report["cpu"],
        f"memory bandwidth (2 threads, read): {report['bandwidth_gbs']} GB/s"
        + f" ({report['bandwidth_measured_gbs']})",
        "| engine | weights MB | C1 tok/s | C1 TTFT ms | C1 TPOT ms | GB/s (share) | W2 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in report["engines"].items():
        c1, w2 = e.get("c1", {}), e.get("w2", {})
        mb = f"{e['weight_bytes'] / 1e6:.0f}" if e.get("weight_bytes") else "-"
        share = f"{e.get('c1_weight_gbs', '-')} ({e.get('c1_bandwidth_share', '-')})"
        lines.append(
            f"| {name} | {mb} | {c1.get('output_throughput', 0):.1f} | "
            f"{c1.get('mean_ttft_ms', 0):.0f} | {c1.get('mean_tpot_ms', 0):.1f} | {share} | "
            f"{w2.get('duration', 0):.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
