"""Offline throughput, workload W1, through the in-process scheduler (no server).

W1: 64 prompts of random token ids (seed 0), lengths uniform in [64, 512], 128 new tokens
each, ignore_eos, greedy. Prints output tokens per second. `--hf` runs the same prompts
through HF transformers `generate` (batches of 16, left padding) for reference.

    python -m bench.bench_offline --dtype bfloat16
    python -m bench.bench_offline --dtype float32 --hf
    python -m bench.bench_offline --dtype bfloat16 --max-running-requests 8 --compare-overlap 3

`--compare-overlap N` loads the model twice (overlap loop on / off), runs W1 N times on each,
alternating so drift hits both alike, and prints the per-run numbers and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

import torch

from bench.records import throughput_fields
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs


def w1_prompts(
    num: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def make_driver(args: argparse.Namespace, overlap: bool | None) -> InProcessDriver:
    """`overlap` None: the server's default loop (the normal loop on CPU)."""
    server_args = ServerArgs(
        model_path=args.model_path,
        dtype=args.dtype,
        load_format=args.load_format,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        disable_radix_cache=args.disable_radix_cache,
        disable_overlap_schedule=None if overlap is None else not overlap,
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
    return InProcessDriver(server_args)


def run_radixrt(args: argparse.Namespace, driver: InProcessDriver | None = None) -> dict:
    """W1 through the in-process driver; with --profile, print where the time goes."""
    if driver is None:
        overlap: bool | None = None  # the server's default loop
        if args.disable_overlap_schedule or args.profile:
            overlap = False  # the profiler does not trace the overlap loop's forward thread
        elif args.enable_overlap_schedule:
            overlap = True
        driver = make_driver(args, overlap=overlap)
    vocab = driver.scheduler.vocab_size
    prompts = w1_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    driver.generate([[1, 2, 3]], {"max_new_tokens": 4})  # warm up kernels
    driver.scheduler.flush_cache()
    profiler = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.start()
    tic = time.perf_counter()
    outs = driver.generate(prompts, params)
    elapsed = time.perf_counter() - tic
    if profiler is not None:
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(json.dumps(time_split(profiler, elapsed)))
    n_out = sum(len(o["output_ids"]) for o in outs)
    n_in = sum(len(p) for p in prompts)
    idle = driver.scheduler.output.idle_tracker
    return {
        "engine": "radixrt",
        "overlap": driver.scheduler.overlap,
        "max_running_requests": driver.scheduler.kv.max_rows,
        "dtype": str(driver.worker.model_config.dtype).removeprefix("torch."),
        **throughput_fields(len(prompts), n_in, n_out, elapsed),
        "worker_idle_fraction": round(idle.idle_s / max(idle.idle_s + idle.busy_s, 1e-9), 4),
    }


def compare_overlap(args: argparse.Namespace) -> list[dict]:
    """Alternate overlap on / off runs of W1; print each and the median throughput ratio."""
    drivers = {on: make_driver(args, overlap=on) for on in (True, False)}
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.compare_overlap):
        for on in (False, True):
            result = run_radixrt(args, drivers[on])
            runs[on].append(result)
            print(json.dumps(result), flush=True)

    def median(on: bool) -> float:
        return statistics.median(r["output_tok_per_s"] for r in runs[on])

    summary = {
        "overlap_on_median_tok_per_s": median(True),
        "overlap_off_median_tok_per_s": median(False),
        "ratio_on_over_off": round(median(True) / median(False), 3),
    }
    print(json.dumps(summary))
    return runs[True] + runs[False]


def run_hf(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from srt.configs.model_config import ModelConfig

    cfg = ModelConfig.from_path(args.model_path, dtype=args.dtype)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=cfg.dtype).eval()
    prompts = w1_prompts(args.num_prompts, args.min_len, args.max_len, cfg.vocab_size, args.seed)
    pad = 0
    tic = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            chunk = prompts[i : i + args.hf_batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            n_out += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - tic
    return {
        "engine": "hf-transformers",
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "num_prompts": len(prompts),
        "output_tokens": n_out,
        "seconds": round(elapsed, 2),
        "output_tok_per_s": round(n_out / elapsed, 1),
    }


MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")


def time_split(prof, wall_s: float) -> dict:
    """Where the profiled wall time goes (named ranges from the runtime, plus the matmuls:
    `aten::mm` / `aten::addmm`, and `mkldnn::_linear_pointwise` for prepacked CPU weights).

    attention / sampling / scheduler are the `record_function` ranges (their Python
    included); the rest is the other layer ops (norms, rope, activations, embedding, logits
    selection) and the model's Python glue. Profiling itself slows the run down ~10%.
    """
    events = {e.key: e for e in prof.key_averages()}

    def range_s(name: str) -> float:
        return events[name].cpu_time_total / 1e6 if name in events else 0.0

    matmul = sum(events[n].self_cpu_time_total for n in MATMUL_OPS if n in events)
    parts = {
        "matmul": matmul / 1e6,
        "attention": range_s("attention"),
        "sampling": range_s("sampling"),
        "scheduler": range_s("scheduler"),
    }
    parts["other_ops_and_python"] = wall_s - sum(parts.values())
    return {"wall_s": round(wall_s, 2)} | {
        k: f"{v:.2f} s ({100 * v / wall_s:.0f}%)" for k, v in parts.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument(
        "--skip-tokenizer-init", action="store_true", help="a model folder without a tokenizer"
    )
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--enable-overlap-schedule", action="store_true", help="the overlap loop on CPU")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument(
        "--compare-overlap", type=int, default=0, metavar="N", help="A/B the two loops, N runs"
    )
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate")
    p.add_argument("--hf-only", action="store_true")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the run and print the time split; runs the normal loop (the profiler "
        "does not trace the overlap loop's forward thread)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.compare_overlap:
        compare_overlap(args)
        return
    results = []
    if not args.hf_only:
        results.append(run_radixrt(args))
    if args.hf or args.hf_only:
        results.append(run_hf(args))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
