"""GPU checks and benchmarks, end to end, in one command.

    python -m bench.bench_gpu [--out gpu_results.md] [--skip-checks] [--models default qwen3-0.6b]

1. Checks: runs the GPU tests (`pytest -m gpu tests/gpu tests/engine/test_cuda_torch_native.py`:
   flashinfer vs torch_native attention at page sizes 1 and 16, greedy equality of the
   default model with flashinfer + graphs vs torch_native, memory integrity after W1 runs,
   graph replay vs eager) and reports pass / fail.
2. Benchmarks, bf16, flashinfer attention, KV pool sized by the memory profile, for each
   model (the default SmolLM2-135M; a Qwen3-0.6B-shaped config with dummy weights) with
   CUDA graphs on and off:
   - decode at batch 1, 64 and 256: one static batch (`bench_one_batch.run_one_batch`) of
     `--decode-input-len` token prompts, `--decode-steps` greedy steps; the median step. With
     `--decode-overlap` also the same batches in steady decode through the overlap loop
     (`gpu_decode_loop.py`), where the host's part of a step hides behind the device's.
     HBM roofline fraction = (weight bytes + KV bytes read in the step) / step time / peak
     bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s, from the device name).
   - W1 scaled up: 256 prompts of random ids, input and output lengths uniform in
     [100, 1024], greedy, ignore_eos, through the in-process scheduler (overlap loop);
     output tokens/s, then the memory integrity check. With graphs on, the same W1 again on
     the normal loop ("overlap off"), for the overlap speed-up. (No roofline for W1: its
     steps mix prefill and decode.)
3. Prints a markdown table (and writes it to `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.gpu_decode_loop import bench_decode_overlap

REPO = Path(__file__).resolve().parents[1]
DECODE_BATCHES = (1, 64, 256)
# Peak HBM bandwidth in bytes/s by device-name fragment, most specific first.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}


def peak_bandwidth(device_name: str) -> float | None:
    for fragment, bandwidth in PEAK_BANDWIDTH:
        if fragment in device_name:
            return bandwidth
    return None


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them, except an untied input
    embedding table, of which a step reads only its batch's rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    if head is not None and head.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def decode_step_bytes(weights: int, batch: int, context_len: int, kv_per_token: int) -> int:
    """HBM bytes of one decode step: the weights plus every request's KV history."""
    return weights + batch * context_len * kv_per_token


def roofline_fraction(step_bytes: int, step_s: float, bandwidth: float | None) -> float | None:
    if bandwidth is None or step_s <= 0:
        return None
    return step_bytes / step_s / bandwidth


def save_qwen3_0_6b_config(folder: Path) -> Path:
    """A config-only folder (`--load-format dummy`) shaped like Qwen3-0.6B."""
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_0_6B).save_pretrained(folder)
    return folder


COLUMN_FORMATS = {
    "tok_per_s": "{:,.0f}",
    "step_ms": "{:.2f}",
    "gb_per_step": "{:.3f}",
    "roofline": "{:.1%}",
}


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(column: str, value: Any) -> str:
        if value is None:
            return ""
        return COLUMN_FORMATS.get(column, "{}").format(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def run_checks() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"]
    cmd.append("tests/engine/test_cuda_torch_native.py")
    tic = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    return {"ok": proc.returncode == 0, "summary": summary, "s": time.perf_counter() - tic}


def server_args(model_path: str | None, load_format: str, graphs: bool) -> Any:
    from srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path,
        load_format=load_format,
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        attention_backend="flashinfer",
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=max(DECODE_BATCHES),
        max_running_requests=max(DECODE_BATCHES),
    )


@contextmanager
def freed_after() -> Iterator[list[Any]]:
    """Holds the worker / driver of one configuration; frees the device after it."""
    held: list[Any] = []
    try:
        yield held
    finally:
        # Popped, not iterated: a loop variable would keep the last driver (and through
        # it the worker and its KV pool) alive past the collection below.
        while held:
            stop_forward_worker(held.pop())
        gc.collect()
        torch.cuda.empty_cache()


def stop_forward_worker(obj: Any) -> None:
    """Stop a driver's overlap thread (a no-op for the normal loop, or when stopped)."""
    forward_worker = getattr(getattr(obj, "scheduler", None), "forward_worker", None)
    if forward_worker is not None:
        forward_worker.close()


def bench_decode(
    worker: Any,
    batch: int,
    input_len: int,
    steps: int,
    bandwidth: float | None,
    overlap: tuple[Any, list[Any]] | None = None,
) -> dict[str, Any]:
    """One decode step of `batch` requests: alone (`bench_one_batch`, the median step), or
    with `overlap` = (server args, held) in steady decode through the overlap loop."""
    from bench.bench_one_batch import run_one_batch
    from srt.model_executor.memory_sizing import kv_bytes_per_token

    if overlap is None:
        step_s = run_one_batch(worker, batch, input_len, steps + 1)["median_decode_latency"]
    else:
        step_s = bench_decode_overlap(worker, overlap[0], batch, input_len, steps, overlap[1])
    cfg = worker.model_config
    step_bytes = decode_step_bytes(
        weight_bytes_read(worker.model_runner.model),
        batch,
        input_len + steps // 2,  # the median step's context
        kv_bytes_per_token(cfg, cfg.dtype),
    )
    return {
        "workload": f"decode bs={batch}" + ("" if overlap is None else ", overlap loop"),
        "tok_per_s": batch / step_s,
        "step_ms": step_s * 1e3,
        "gb_per_step": step_bytes / 1e9,
        "roofline": roofline_fraction(step_bytes, step_s, bandwidth),
    }


def bench_w1(driver: Any, num: int, lo: int, hi: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = driver.scheduler.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
    params = [
        {"max_new_tokens": rng.randint(lo, hi), "ignore_eos": True, "temperature": 0}
        for _ in range(num)
    ]
    driver.generate([[1, 2, 3]], {"max_new_tokens": 4})  # warm-up
    tic = time.perf_counter()
    outs = driver.generate(prompts, params)
    elapsed = time.perf_counter() - tic
    driver.scheduler.check_memory()
    n_out = sum(len(o["output_ids"]) for o in outs)
    return {"workload": f"W1x ({num} prompts)", "tok_per_s": n_out / elapsed, "s": elapsed}


def bench_w1_loops(
    worker: Any,
    sargs: Any,
    num: int,
    lo: int,
    hi: int,
    overlaps: tuple[bool, ...],
    held: list[Any],
) -> Iterator[dict[str, Any]]:
    """W1 on one worker, once per loop in `overlaps` (True: the overlap loop), same prompts."""
    from managers.inprocess import InProcessDriver

    for overlap in overlaps:
        loop_args = dataclasses.replace(sargs, disable_overlap_schedule=not overlap)
        driver = InProcessDriver(loop_args, worker=worker)
        held.append(driver)
        w1 = bench_w1(driver, num, lo, hi)
        w1["workload"] += "" if overlap else " overlap off"
        stop_forward_worker(driver)
        # The KV pool is the worker's: return the cached pages before the next scheduler
        # takes the pool over.
        assert driver.scheduler.flush_cache(), "flush refused: requests still held"
        yield w1


def bench_model(name: str, path: str | None, fmt: str, args: argparse.Namespace) -> list[dict]:
    """Decode and W1 benchmarks of one model, CUDA graphs on then off."""
    rows = []
    for graphs in (g == "on" for g in args.graphs):
        with freed_after() as held:
            # In a function of its own: its locals (the worker, its runner) are gone when it
            # returns, so `freed_after` can give the device back before the next worker
            # sizes its KV pool from the free memory.
            rows += bench_config(name, path, fmt, graphs, args, held)
    return rows


def bench_config(
    name: str, path: str | None, fmt: str, graphs: bool, args: argparse.Namespace, held: list
) -> list[dict]:
    from bench.bench_one_batch import run_one_batch
    from managers.model_worker import ModelWorker

    rows = []
    sargs = server_args(path, fmt, graphs)
    worker = ModelWorker(sargs)
    held.append(worker)
    runner = worker.model_runner
    captured = runner.cuda_graph_runner is not None
    assert captured == graphs, f"graphs {'on' if graphs else 'off'}: captured={captured}"
    base = {"model": name, "graphs": "on" if graphs else "off"}
    base["kv_pool_tokens"] = runner.max_total_tokens
    # The static decode batches run on the worker alone, before a scheduler owns it.
    run_one_batch(worker, 1, args.decode_input_len, 8)  # warm-up
    for batch in DECODE_BATCHES:
        decode = bench_decode(worker, batch, args.decode_input_len, args.steps, args.peak_bandwidth)
        rows.append(base | decode)
        print(json.dumps(rows[-1]), flush=True)
    if args.decode_overlap:
        for batch in DECODE_BATCHES:
            decode = bench_decode(
                worker,
                batch,
                args.decode_input_len,
                args.steps,
                args.peak_bandwidth,
                (sargs, held),
            )
            rows.append(base | decode)
            print(json.dumps(rows[-1]), flush=True)
    if args.profile:
        for batch in (1, max(DECODE_BATCHES)):
            run_one_batch(worker, batch, args.decode_input_len, 17, profile=True)
    # W1 with the overlap loop; with graphs on, the same W1 again on the normal loop (same
    # worker, same prompts), for the overlap on / off ratio.
    loops = (True, False) if graphs else (True,)
    if args.w1_prompts == 0:
        return rows
    for w1 in bench_w1_loops(worker, sargs, args.w1_prompts, 100, 1024, loops, held):
        rows.append(base | w1)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["default", "qwen3-0.6b"])
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--graphs", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument(
        "--profile",
        action="store_true",
        help="print host and device profiles of 16 decode steps at batch 1 and 256, per "
        "configuration",
    )
    p.add_argument("--decode-input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64, help="decode steps per decode benchmark")
    p.add_argument("--w1-prompts", type=int, default=256, help="0: no W1 run")
    p.add_argument(
        "--decode-overlap",
        action="store_true",
        help="also time decode steps in steady state through the overlap loop",
    )
    p.add_argument("--peak-tbs", type=float, default=None, help="HBM TB/s (default: by name)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    bandwidth = args.peak_tbs * 1e12 if args.peak_tbs else peak_bandwidth(device)
    args.peak_bandwidth = bandwidth
    checks = None if args.skip_checks else run_checks()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "default": ("SmolLM2-135M", None, "auto"),
            "qwen3-0.6b": (
                "Qwen3-0.6B-shape (dummy)",
                str(save_qwen3_0_6b_config(Path(tmp))),
                "dummy",
            ),
        }
        for key in args.models:
            rows += bench_model(*models[key], args)
    columns = ["model", "graphs", "workload", "tok_per_s", "step_ms", "gb_per_step", "roofline"]
    columns.append("kv_pool_tokens")
    text = [f"GPU: {device}, peak HBM {bandwidth / 1e12 if bandwidth else 'n/a'} TB/s", ""]
    if checks is not None:
        verdict = "passed" if checks["ok"] else "FAILED"
        text += [f"GPU checks {verdict}: {checks['summary']}", ""]
    text.append(markdown_table(rows, columns))
    print("\n".join(text))
    if args.out:
        Path(args.out).write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
