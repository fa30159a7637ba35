"""Time float32 vs bfloat16 linear layers at SmolLM2-135M shapes on this machine.

The numbers decide what ``--dtype auto`` picks on CPU (see ``srt/configs/dtype.py``).

Usage: ``python -m bench.bench_dtype [--tokens 1 64 512] [--min-time 0.3] [--prepacked]``

``--prepacked`` times the oneDNN-prepacked weights the model runner uses on CPU
(``srt/layers/cpu_packed.py``) instead of plain ``F.linear``: run both to see what packing buys.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt.layers.cpu_packed import can_pack, pack_weight, packed_linear

logger = logging.getLogger(__name__)

# SmolLM2-135M: hidden 576, intermediate 1536, 9 q heads / 3 kv heads of 64, vocab 49152.
HIDDEN = 576
INTERMEDIATE = 1536
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
VOCAB = 49152
NUM_LAYERS = 30

# (name, in_features, out_features, times used per forward)
SHAPES: list[tuple[str, int, int, int]] = [
    ("qkv_proj", HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, NUM_LAYERS),
    ("o_proj", NUM_HEADS * HEAD_DIM, HIDDEN, NUM_LAYERS),
    ("gate_up_proj", HIDDEN, 2 * INTERMEDIATE, NUM_LAYERS),
    ("down_proj", INTERMEDIATE, HIDDEN, NUM_LAYERS),
    ("lm_head", HIDDEN, VOCAB, 1),
]


@dataclass(slots=True)
class Result:
    name: str
    tokens: int
    dtype: torch.dtype
    seconds: float
    gflops: float


def time_linear(
    m: int, k: int, n: int, dtype: torch.dtype, min_time: float, prepacked: bool = False
) -> float:
    """Median-free simple timer: mean seconds per call over at least ``min_time`` seconds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    if prepacked and can_pack(w):
        packed = pack_weight(w)

        def linear() -> torch.Tensor:
            return packed_linear(x, packed, None)
    else:

        def linear() -> torch.Tensor:
            return F.linear(x, w)

    with torch.inference_mode():
        for _ in range(3):
            linear()
        calls = 0
        start = time.perf_counter()
        while True:
            linear()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time and calls >= 5:
                return elapsed / calls


def run(tokens: list[int], min_time: float, prepacked: bool = False) -> list[Result]:
    results: list[Result] = []
    for m in tokens:
        for name, k, n, _ in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                sec = time_linear(m, k, n, dtype, min_time, prepacked)
                results.append(Result(name, m, dtype, sec, 2.0 * m * k * n / sec / 1e9))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--prepacked", action="store_true", help="oneDNN-prepacked weights")
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{'oneDNN-prepacked weights' if args.prepacked else 'F.linear'}"
    )
    results = run(args.tokens, args.min_time, args.prepacked)
    print(f"{'shape':<13}{'M':>5}{'fp32 GFLOP/s':>14}{'bf16 GFLOP/s':>14}{'bf16/fp32':>11}")
    by_key = {(r.name, r.tokens, r.dtype): r for r in results}
    for m in args.tokens:
        total = {torch.float32: 0.0, torch.bfloat16: 0.0}
        for name, _, _, uses in SHAPES:
            f32 = by_key[(name, m, torch.float32)]
            b16 = by_key[(name, m, torch.bfloat16)]
            total[torch.float32] += f32.seconds * uses
            total[torch.bfloat16] += b16.seconds * uses
            print(
                f"{name:<13}{m:>5}{f32.gflops:>14.1f}{b16.gflops:>14.1f}"
                f"{f32.seconds / b16.seconds:>10.2f}x"
            )
        print(
            f"{'forward':<13}{m:>5}  fp32 {total[torch.float32] * 1e3:8.2f} ms  "
            f"bf16 {total[torch.bfloat16] * 1e3:8.2f} ms  "
            f"speedup {total[torch.float32] / total[torch.bfloat16]:.2f}x"
        )


if __name__ == "__main__":
    main()
