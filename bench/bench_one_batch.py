"""Latency of one static batch: one prefill step, then decode steps. No server, no scheduler.

Builds a `ModelWorker` directly, makes B random prompts of `--input-len` tokens, runs them as
one `ScheduleBatch` (prefill, then `--output-len - 1` greedy decode steps) and times each
step the way SGLang's `bench_one_batch` does: KV allocation, batch snapshot, forward and
sampling (which ends with a device -> host copy of the tokens, so the device is synced).

    python -m bench.bench_one_batch --batch-size 1 8 64 --input-len 256 --output-len 32 \
        --dtype bfloat16 --load-format dummy --result-filename out.jsonl [--profile]

Every `ServerArgs` flag is accepted (--model-path, --page-size, --attention-backend, ...);
--max-total-tokens defaults to what the largest batch needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from managers.model_worker import ModelWorker
from managers.req import Req
from managers.schedule_batch import ScheduleBatch
from mem_cache.chunk_cache import ChunkCache
from mem_cache.kv_manager import KVManager
from srt.sampling.sampling_params import SamplingParams
from srt.server_args_cli import add_cli_args, from_cli_args


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    tic = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - tic


def run_one_batch(
    worker: ModelWorker,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    *,
    profile: bool = False,
    run_name: str = "default",
) -> dict[str, Any]:
    """Prefill B prompts at once, decode `output_len - 1` steps, free all KV; return timings.

    `output_ids` (the greedy tokens of each request) is returned too, for checking; leave it
    out when logging the result.
    """
    if output_len < 1:
        raise ValueError("output_len must be >= 1")
    cfg = worker.model_config
    rows, allocator = worker.get_memory_pool()
    # No prefix sharing: every request owns its KV, and a later batch cannot hit this one's.
    kv = KVManager(rows, allocator, ChunkCache(allocator.page_size))
    params = SamplingParams.from_dict(
        {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    )
    params.normalize()
    prompts = random_prompts(batch_size, input_len, cfg.vocab_size, seed)
    reqs = [
        Req(f"bench-{i}", p, params, sampling_seed=seed + i, eos_token_ids=frozenset())
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        req.init_next_round_input(kv)
    spans = [r.kv for r in reqs]

    def run(batch: ScheduleBatch) -> list[int]:
        mwb = batch.model_worker_batch(cfg.vocab_size, [])
        return worker.forward_batch_generation(mwb).next_token_ids

    def prefill() -> list[int]:
        loc = kv.allocate_extend(spans, [len(r.fill_ids) for r in reqs])
        return run(ScheduleBatch.extend(reqs, loc))

    def decode() -> list[int]:
        return run(ScheduleBatch.decode(reqs, kv.allocate_decode(spans)))

    def append(tokens: list[int]) -> None:
        for req, tok in zip(reqs, tokens, strict=True):
            req.output_ids.append(tok)

    try:
        tokens, prefill_latency = _timed(prefill)
        append(tokens)
        decode_latencies: list[float] = []
        prof = _profiler() if profile else contextlib.nullcontext()
        with prof:
            for _ in range(output_len - 1):
                tokens, latency = _timed(decode)
                append(tokens)
                decode_latencies.append(latency)
    finally:
        for req in reqs:
            if req.kv.row is not None:
                kv.cache_finished(req)
    kv.check_integrity([])
    if profile:
        # The host's side first: on a GPU a small decode step is bound by it (H200, batch 1:
        # 2.5 ms a step, ~0.3 ms of it kernels), so the device table alone hides the cost.
        events = prof.key_averages()
        print(f"Decode profile, batch size {batch_size}, by host time:")
        print(events.table(sort_by="self_cpu_time_total", row_limit=20))
        if torch.cuda.is_available():
            print(f"Decode profile, batch size {batch_size}, by device time:")
            print(events.table(sort_by="self_cuda_time_total", row_limit=20))

    total_latency = prefill_latency + sum(decode_latencies)
    median_decode = statistics.median(decode_latencies) if decode_latencies else 0.0
    return {
        "run_name": run_name,
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill_latency,
        "prefill_throughput": batch_size * input_len / prefill_latency,
        "median_decode_latency": median_decode,
        "median_decode_throughput": batch_size / median_decode if median_decode else 0.0,
        "total_latency": total_latency,
        "overall_throughput": batch_size * (input_len + output_len) / total_latency,
        "output_ids": [req.output_ids for req in reqs],
    }


def _profiler() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def format_result(r: dict[str, Any]) -> str:
    return (
        f"Batch size: {r['batch_size']}, input_len: {r['input_len']}, "
        f"output_len: {r['output_len']}\n"
        f"Prefill. latency: {r['prefill_latency']:.5f} s, "
        f"throughput: {r['prefill_throughput']:10.2f} token/s\n"
        f"Decode.  median latency: {r['median_decode_latency']:.5f} s, "
        f"median throughput: {r['median_decode_throughput']:10.2f} token/s\n"
        f"Total. latency: {r['total_latency']:.3f} s, "
        f"throughput: {r['overall_throughput']:10.2f} token/s"
    )


def pool_tokens(max_bs: int, input_len: int, output_len: int, page_size: int) -> int:
    """KV slots the largest batch needs, whole pages per request, plus a little slack."""
    pages_per_req = -(-(input_len + output_len) // page_size)
    return (max_bs * pages_per_req + 4) * page_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--run-name", default="default")
    p.add_argument("--result-filename", default=None, help="append one JSON line per batch")
    p.add_argument("--profile", action="store_true", help="profile the decode steps")
    add_cli_args(p)
    args = p.parse_args(argv)
    server_args = from_cli_args(args)
    logging.basicConfig(level=server_args.log_level.upper())
    max_bs = max(args.batch_size)
    if server_args.max_total_tokens is None:
        server_args.max_total_tokens = pool_tokens(
            max_bs, args.input_len, args.output_len, server_args.page_size
        )
    if server_args.max_running_requests is None:
        server_args.max_running_requests = max_bs
    worker = ModelWorker(server_args)
    if args.input_len + args.output_len > worker.model_config.context_len:
        raise SystemExit(
            f"input_len + output_len exceeds the context length {worker.model_config.context_len}"
        )

    # Warm up kernels and allocator paths on a small batch before anything is timed.
    run_one_batch(worker, 1, args.input_len, min(args.output_len, 4), args.seed)
    for bs in args.batch_size:
        result = run_one_batch(
            worker,
            bs,
            args.input_len,
            args.output_len,
            args.seed,
            profile=args.profile,
            run_name=args.run_name,
        )
        result.pop("output_ids")
        print(format_result(result), flush=True)
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
