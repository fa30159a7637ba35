"""Get a lent GPU's 15 device minutes spent running, not preparing.

    bash bench/gpu_session.sh prepare [--dry-run]   # here, with PyPI: builds .gpu/
    bash bench/gpu_session.sh plan                  # prints the device calls, in order
    python -m bench.gpu_session warm                # there: JIT-compiles FlashInfer's kernels

The device machine (Python 3.12, torch 2.11.0+cu130, transformers 5.17, pytest, nvcc, ninja)
has no network, and each call carries at most 64 MiB: the working tree plus `carry`.
`prepare` (`gpu_prepare.py`) builds the carry folder `.gpu/`; `plan` (`gpu_plan.py`) prints
the calls that carry it; `warm` runs there, before the tests, so they find FlashInfer's
modules compiled.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.gpu_plan import print_plan
from bench.gpu_prepare import aot_build, prepare

# (heads, kv heads, head dim): SmolLM2-135M (and the tests' hd64 shapes), Qwen3-0.6B, and a
# group of 4 (tensor-core decode, as the tests' qwen3_hd128_gqa4 config).
WARM_SHAPES = [(9, 3, 64), (16, 8, 128), (32, 8, 128)]


def warm_one(heads: int, kv_heads: int, head_dim: int) -> None:
    """Runs RadixRT's own FlashInfer backend (ragged prefill, paged prefill on a prefix,
    decode) at page sizes 1 and 16, so exactly the modules it uses get compiled."""
    import time

    import torch

    from attention import RadixAttention, create_attention_backend
    from srt.model_executor.forward_batch import ForwardMode
    from tests.srt.forward_helpers import ForwardBatchBuilder

    tic = time.perf_counter()
    for page_size in (1, 16):
        backend = create_attention_backend(
            "flashinfer",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=torch.bfloat16,
            device="cuda",
            page_size=page_size,
        )
        builder = ForwardBatchBuilder(
            1,
            kv_heads,
            head_dim,
            dtype=torch.bfloat16,
            num_slots=4096,
            backend=backend,
            page_size=page_size,
            device="cuda",
        )
        layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0)
        steps = [([(0, 40), (1, 17)], None), ([(0, 5), (2, 9)], ForwardMode.MIXED)]
        steps += [([(0, 1), (1, 1), (2, 1)], None)]
        for lens, mode in steps:
            fb = builder.build([(rid, [0] * n) for rid, n in lens], mode=mode)
            total = sum(n for _, n in lens)
            q = torch.randn(total, heads * head_dim, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(total, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16)
            layer(q, kv, kv, fb)
        torch.cuda.synchronize()
    took = time.perf_counter() - tic
    print(f"warm: {heads}/{kv_heads} heads, head_dim {head_dim}: {took:.0f} s", flush=True)


def warm() -> None:
    """One process per shape, at once: FlashInfer locks each module, so shared ones build
    once while different head_dims build side by side."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.gpu_session", "warm-one", *map(str, s)])
        for s in WARM_SHAPES
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"warm-up failed: exit codes {codes}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="build .gpu/ (downloads from PyPI)")
    prep.add_argument("--dry-run", action="store_true", help="print what it would download")
    sub.add_parser("plan", help="print the device calls (no network, no GPU)")
    sub.add_parser("warm", help="on the device: JIT-compile FlashInfer's kernels")
    aot = sub.add_parser("aot-build", help="(prepare runs it) compile aot_specs into a folder")
    aot.add_argument("out", type=Path)
    one = sub.add_parser("warm-one")
    one.add_argument("shape", nargs=3, type=int)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dry_run)
    elif args.cmd == "plan":
        print_plan()
    elif args.cmd == "warm":
        warm()
    elif args.cmd == "aot-build":
        aot_build(args.out)
    else:
        warm_one(*args.shape)


if __name__ == "__main__":
    main()
