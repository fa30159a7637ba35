"""oneDNN-prepacked weights for the CPU matmuls of linear layers and the LM head.

`F.linear` on CPU calls MKL's sgemm on a plain `[out, in]` weight, which re-blocks the weight
for every call: at the small row counts of decode (one row per running request) that is most
of the cost. oneDNN can block the weight once, at load time, into the layout its kernels read
(`torch.ops.mkldnn._reorder_linear_weight`), and then run `_linear_pointwise` against it.
Measured on SmolLM2-135M's linear shapes (2-core AMD EPYC, torch 2.13; `python -m
bench.bench_dtype --tokens 16 256 1024` with and without `--prepacked`): float32 2.0x faster at
16 rows, 1.5x at 256-1024 rows (with oneDNN capped to AVX2: 1.7x and 1.2x); bfloat16
1.4-2.2x faster at 16 rows (runs vary), the same at 1024. A decode step at batch 16
(`bench/bench_one_batch.py`): float32 178 -> 134 ms, bfloat16 87 -> 74 ms.

Weights also get a second packed copy, in the panels of `attention/csrc/packed_linear.c`
(float32; bfloat16 where the CPU has AVX512_BF16), and inputs of at most `SMALL_ROWS` rows
(decode, one row per running request; small extends) run that kernel: it streams each panel
once at the FMA rate, where oneDNN's small-row kernels do not. In bfloat16 the kernel either
multiplies with `vdpbf16ps` or widens the weights to float32 FMAs, as the machine's measured
plan says (`attention.cpu_kernels.bf16_matmul_plan`); where the widened kernel also beat
oneDNN at a prefill size (a CPU whose `vdpbf16ps` is slow and that has no AMX), bfloat16
inputs of every size run the panels (`PackedLinearKernel.runs_all_rows`): on the 2-core Xeon
a 384-token bf16 prefill of SmolLM2-135M took 713 ms through oneDNN and 411 ms widened
(float32: 349 ms).
SmolLM2-135M's 121 matmuls (30 layers' qkv, o, gate-up, down, and the LM head), weights from
DRAM, medians (scratch script, 2-core AMD EPYC Zen 4), oneDNN -> kernel: float32 1 row 28.6
-> 20.6 ms, 16 rows 33.3 -> 29.5 ms (re-run 32.9 -> 27.9), 64 rows 93.7 -> 89.5 ms (capped to
AVX2: 25.3 -> 17.2, 41.4 -> 35.7, 108.9 -> 95.6 ms); bfloat16 1 row 13.9 -> 9.4 ms, 16 rows
18.6 -> 13.2 ms, 64 rows 47.9 -> 42.2 ms. At prefill sizes oneDNN stays ahead (float32 544
rows 561 vs 591 ms, 2048 rows 2102 vs 2169 ms), so larger inputs keep it. The cost is one
more copy of the matmul weights. The kernel keeps its accumulators in registers and
prefetches a steady distance ahead of the weights it multiplies (its comment says how); on a
2-core Xeon (avx512_bf16, no AMX; float32 weights from DRAM) the 121 matmuls take 1 row 17.7
ms, 16 rows 25.5 ms and 64 rows 60 ms (oneDNN 16 rows: 38.1 ms).

A packed weight is an opaque oneDNN tensor beside the dense parameter, which stays the
source of truth (weight loading, tied embeddings, tests). Under tensor parallelism the dense
parameter is this rank's shard, and the shard is what gets packed. Packing is CPU-only and skipped
for dtypes the CPU's oneDNN cannot run (float16 without AVX512-FP16, bf16 without AVX512).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from attention.cpu_kernels import PackedLinearKernel, packed_linear_kernel

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Inputs of at most this many rows run the compiled panel kernel; larger ones, oneDNN.
SMALL_ROWS = 64


def can_pack(weight: torch.Tensor) -> bool:
    """Is there a oneDNN CPU kernel for this dense 2-D weight?"""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-blocked copy of a dense `[out, in]` weight, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b against a weight from `pack_weight`; x [..., in] in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackableLinear(nn.Module):
    """Base of modules whose `forward` is `x @ weight.T + bias`: `pack_for_cpu()` adds packed
    copies that `linear()` then uses for CPU inputs of the weight's dtype (the panels up to
    `SMALL_ROWS` rows, oneDNN's above)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed_weight: torch.Tensor | None = None
    panel_weight: torch.Tensor | None = None  # the compiled kernel's panels
    panel_kernel: PackedLinearKernel | None = None

    def pack_for_cpu(self) -> bool:
        if not can_pack(self.weight):
            return False
        self.packed_weight = pack_weight(self.weight)
        kernel = packed_linear_kernel()  # None where it cannot be built
        if kernel is not None and kernel.accepts(self.weight):
            self.panel_kernel = kernel
            self.panel_weight = kernel.pack(self.weight)
        return True

    def linear(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x @ weight.T (+ bias unless `add_bias` is False: a row-parallel layer adds it once,
        after summing the ranks' partial products)."""
        bias = self.bias if add_bias else None
        packed = self.packed_weight
        if packed is not None and not x.is_cuda and x.dtype == packed.dtype:
            kernel = self.panel_kernel
            if kernel is not None and (
                x.numel() <= SMALL_ROWS * x.shape[-1] or kernel.runs_all_rows(x.dtype)
            ):
                return kernel(x, self.panel_weight, self.weight.shape[0], bias)
            return packed_linear(x, packed, bias)
        return torch.nn.functional.linear(x, self.weight, bias)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Pack every linear weight of a CPU model; returns how many were packed."""
    packed = sum(1 for m in model.modules() if isinstance(m, PackableLinear) and m.pack_for_cpu())
    logger.info("CPU weights: %d matmul weights prepacked for oneDNN", packed)
    return packed
