"""Prepacked weights (oneDNN, MKL, compiled panels) for the CPU matmuls of linear layers and
the LM head.

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
(decode, one row per running request; small extends) run that kernel (larger ones too where
the machine's plan says, below): it streams each panel once at the FMA rate, where oneDNN's
small-row kernels do not. In bfloat16 the kernel either multiplies with `vdpbf16ps` or widens
the weights to float32 FMAs, as the machine's measured plan says
(`attention.cpu_kernels.bf16_matmul_plan`); where the widened kernel also beat oneDNN at a
prefill size (a CPU whose `vdpbf16ps` is slow and that has no AMX), bfloat16 inputs of every
size run the panels (`PackedLinearKernel.runs_all_rows`): on the 2-core Xeon
a 384-token bf16 prefill of SmolLM2-135M took 713 ms through oneDNN and 411 ms widened
(float32: 349 ms).
SmolLM2-135M's 121 matmuls (30 layers' qkv, o, gate-up, down, and the LM head), weights from
DRAM, medians (scratch script, 2-core AMD EPYC Zen 4), oneDNN -> kernel: float32 1 row 28.6
-> 20.6 ms, 16 rows 33.3 -> 29.5 ms (re-run 32.9 -> 27.9), 64 rows 93.7 -> 89.5 ms (capped to
AVX2: 25.3 -> 17.2, 41.4 -> 35.7, 108.9 -> 95.6 ms); bfloat16 1 row 13.9 -> 9.4 ms, 16 rows
18.6 -> 13.2 ms, 64 rows 47.9 -> 42.2 ms. At prefill sizes oneDNN stayed ahead there (float32
544 rows 561 vs 591 ms, 2048 rows 2102 vs 2169 ms). The cost is one
more copy of the matmul weights. The kernel keeps its accumulators in registers and
prefetches a steady distance ahead of the weights it multiplies (its comment says how); on a
2-core Xeon (avx512_bf16, no AMX; float32 weights from DRAM) the 121 matmuls take 1 row 17.7
ms, 16 rows 25.5 ms and 64 rows 60 ms (oneDNN 16 rows: 38.1 ms).

In float32, inputs past `SMALL_ROWS` rows (prefill) run whichever of oneDNN, MKL's packed
sgemm and the panels is fastest on the machine (`f32_matmul_plan`: timed once per machine and
torch build over one decoder layer's four matmuls, and kept, as the bf16 plan is;
`RADIXRT_CPU_F32_MATMUL=onednn|mkl|panels` pins it). Each wins somewhere: on the 2-core Xeon
MKL (a [3072, 576] weight at 384 rows: oneDNN 3.85, MKL 3.21 ms; a 304-token prefill's
matmuls: 187.6, 180.8 ms); on the Zen 4 EPYC above, oneDNN; on a 2-core EPYC (Zen 3,
AVX2 only) the panels: SmolLM2's 120 layer matmuls, weights from DRAM, fastest of 5 (scratch
script), 96 rows oneDNN 184 / MKL 190 / panels 144 ms, 384 rows 535 / 554 / 461 ms, 768 rows
1213 / 1084 / 945 ms (panels ~172 GFLOP/s of the two cores' ~192 peak, oneDNN ~150), and W1
float32 (`python -m bench.bench_offline`, alternating runs) 73.7 / 73.0 s with oneDNN
against 69.1 / 64.0 s with the panels. MKL's copy replaces oneDNN's; the panels need none.

A packed weight is an opaque oneDNN (or MKL) tensor beside the dense parameter, which stays the
source of truth (weight loading, tied embeddings, tests). Under tensor parallelism the dense
parameter is this rank's shard, and the shard is what gets packed. Packing is CPU-only and skipped
for dtypes the CPU's oneDNN cannot run (float16 without AVX512-FP16, bf16 without AVX512).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attention.cpu_kernels import (
    PackedLinearKernel,
    cache_dir,
    cpu_flags,
    kept_plan,
    median_ms,
    packed_linear_kernel,
)

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Inputs of at most this many rows run the compiled panel kernel; larger ones, oneDNN (or,
# float32, MKL's packed sgemm where the machine's plan says: `f32_matmul_plan`).
SMALL_ROWS = 64
# The row count MKL packs a float32 weight for; the packed weight serves every row count.
MKL_PACK_ROWS = 256
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


F32_LIBRARIES = ("onednn", "mkl", "panels")


@dataclass(frozen=True)
class F32MatmulPlan:
    """Which library runs the float32 matmuls past `SMALL_ROWS` rows (prefill) on this CPU:
    oneDNN's prepacked kernel (`onednn`), MKL's packed sgemm (`mkl`, weights packed once by
    `cblas_sgemm_pack` through `torch.ops.mkl`), or the compiled panels that run the small
    inputs (`panels`: every row count then runs one kernel, and no second packed copy is
    kept). `timings_ms` holds what it was chosen from."""

    library: str
    timings_ms: dict[str, float]

    def describe(self) -> str:
        timed = ", ".join(f"{k} {v:.3f} ms" for k, v in self.timings_ms.items())
        return self.library + (f" ({timed})" if timed else "")


def mkl_packing_available() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def f32_libraries() -> list[str]:
    """The libraries this machine and torch build can run float32 prefill matmuls with."""
    return [
        lib
        for lib in F32_LIBRARIES
        if (lib != "mkl" or mkl_packing_available())
        and (lib != "panels" or packed_linear_kernel() is not None)
    ]


@functools.cache
def f32_matmul_plan() -> F32MatmulPlan:
    """This machine's choice for float32 inputs past `SMALL_ROWS` rows.
    `RADIXRT_CPU_F32_MATMUL=onednn|mkl|panels` pins it; by default (`auto`) each library is
    timed once per machine and torch build (~1 s) and the choice is kept under the kernel
    cache (`attention.cpu_kernels.kept_plan`), so every process runs the same kernels and a
    float32 output does not depend on which process computed it."""
    choice = os.environ.get("RADIXRT_CPU_F32_MATMUL", "auto").lower()
    if choice != "auto" and choice not in F32_LIBRARIES:
        raise ValueError(f"RADIXRT_CPU_F32_MATMUL={choice!r}: expected auto, onednn, mkl or panels")
    candidates = f32_libraries()
    if choice != "auto":
        if choice not in candidates:
            raise ValueError(f"RADIXRT_CPU_F32_MATMUL={choice}: not available on this machine")
        return F32MatmulPlan(choice, {})
    if len(candidates) == 1:
        return F32MatmulPlan(candidates[0], {})
    # What the kernels run on: the torch build (its MKL and oneDNN), the CPU, the ISA caps,
    # and the libraries compared.
    caps = [os.environ.get(v, "") for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")]
    key = hashlib.sha256("\0".join([torch.__version__, cpu_flags(), *caps, *candidates]).encode())
    saved = cache_dir() / f"f32-matmul-plan-{key.hexdigest()[:16]}.json"
    plan = kept_plan(saved, F32MatmulPlan, functools.partial(_measure_f32_plan, candidates))
    logger.info("CPU float32 matmuls past %d rows: %s", SMALL_ROWS, plan.describe())
    return plan


# One decoder layer of SmolLM2-135M ([out, in]: qkv, o, gate-up, down): what the plan times.
_PLAN_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_PLAN_ROWS = (96, 384)


def _measure_f32_plan(candidates: list[str]) -> F32MatmulPlan:
    """Time each candidate library on one decoder layer's four matmuls (`_PLAN_SHAPES`) at two
    prefill sizes, the best of three interleaved tries (a slow try is the machine's noise, not
    the library's); the fastest in sum is chosen."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.05 for shape in _PLAN_SHAPES]
    kernel = packed_linear_kernel()
    runs: dict[str, Callable[[torch.Tensor, int], object]] = {}
    if "onednn" in candidates:
        onednn = [pack_weight(w) for w in weights]
        runs["onednn"] = lambda x, i: packed_linear(x, onednn[i], None)
    if "mkl" in candidates:
        mkl = [mkl_pack_weight(w) for w in weights]
        runs["mkl"] = lambda x, i: mkl_linear(x, mkl[i], weights[i], None)
    if "panels" in candidates and kernel is not None:  # a candidate only with the kernel
        panels = [kernel.pack(w) for w in weights]
        runs["panels"] = lambda x, i: kernel(x, panels[i], weights[i].shape[0])
    timings: dict[str, float] = {}
    for rows in _PLAN_ROWS:
        inputs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
        for _ in range(3):  # interleaved, so that a slow stretch of the machine hits all
            for lib, run in runs.items():
                ms = median_ms(lambda r=run, xs=inputs: [r(x, i) for i, x in enumerate(xs)], reps=3)
                key = f"{lib}_{rows}"
                timings[key] = min(timings.get(key, ms), ms)
    totals = {lib: sum(timings[f"{lib}_{rows}"] for rows in _PLAN_ROWS) for lib in runs}
    return F32MatmulPlan(min(totals, key=totals.__getitem__), timings)


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


def mkl_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy (`cblas_sgemm_pack`) of a dense float32 `[out, in]` weight, for
    `mkl_linear`."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), MKL_PACK_ROWS)


def mkl_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T + b (float32) against a weight from `mkl_pack_weight`. A
    packed B holds the whole weight, whatever the row count it was packed for (MKL's
    `cblas_sgemm_compute` reads it for any m); `_mkl_linear` takes the packed path only when
    told the input's row count, so it is told."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


class PackableLinear(nn.Module):
    """Base of modules whose `forward` is `x @ weight.T + bias`: `pack_for_cpu()` adds packed
    copies that `linear()` then uses for CPU inputs of the weight's dtype: the panels up to
    `SMALL_ROWS` rows, and above, `large_rows` (the float32 plan's library; oneDNN's copy for
    bfloat16 unless its plan runs the panels at every row count)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    large_rows: str | None = None  # what runs inputs past SMALL_ROWS; None: not packed
    packed_weight: torch.Tensor | None = None  # oneDNN's (or MKL's) copy, if large_rows is
    panel_weight: torch.Tensor | None = None  # the compiled kernel's panels
    panel_kernel: PackedLinearKernel | None = None

    def pack_for_cpu(self) -> bool:
        if not can_pack(self.weight):
            return False
        kernel = packed_linear_kernel()  # None where it cannot be built
        if kernel is not None and kernel.accepts(self.weight):
            self.panel_kernel = kernel
            self.panel_weight = kernel.pack(self.weight)
        library = "onednn"
        if self.weight.dtype == torch.float32:
            library = f32_matmul_plan().library
        if library == "panels" and self.panel_weight is None:
            library = "onednn"
        if library == "mkl":
            self.packed_weight = mkl_pack_weight(self.weight)
        elif library == "onednn":
            self.packed_weight = pack_weight(self.weight)
        self.large_rows = library
        return True

    def linear(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x @ weight.T (+ bias unless `add_bias` is False: a row-parallel layer adds it once,
        after summing the ranks' partial products)."""
        bias = self.bias if add_bias else None
        library = self.large_rows
        if library is not None and not x.is_cuda and x.dtype == self.weight.dtype:
            kernel = self.panel_kernel
            if kernel is not None and (
                library == "panels"
                or x.numel() <= SMALL_ROWS * x.shape[-1]
                or kernel.runs_all_rows(x.dtype)
            ):
                return kernel(x, self.panel_weight, self.weight.shape[0], bias)
            if library == "mkl":
                return mkl_linear(x, self.packed_weight, self.weight, bias)
            return packed_linear(x, self.packed_weight, bias)
        return torch.nn.functional.linear(x, self.weight, bias)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Pack every linear weight of a CPU model; returns how many were packed. The panels then
    move into one arena (`panels_onto_huge_pages`)."""
    modules = [m for m in model.modules() if isinstance(m, PackableLinear) and m.pack_for_cpu()]
    logger.info("CPU weights: %d matmul weights prepacked", len(modules))
    panels_onto_huge_pages(modules)
    return len(modules)


def panels_onto_huge_pages(modules: list[PackableLinear]) -> None:
    """Move the modules' panel weights, back to back, into one anonymous mapping advised for
    transparent huge pages (`MADV_HUGEPAGE`; Linux's default THP policy, `madvise`, gives
    them to such mappings only) and starting on a 2 MiB boundary. The panels' views keep the
    mapping alive.

    Every decode step streams all the panels, and with 4 KiB pages each page costs a TLB miss
    (a dear one in a VM, with nested page tables). One arena, not a mapping per weight: a
    mapping gets huge pages only for the whole 2 MiB-aligned ranges inside it, which a small
    weight (SmolLM2's o_proj, 1.3 MiB) never has. Measured on a 2-core EPYC (Zen 3, a VM),
    SmolLM2's 121 float32 matmuls from DRAM, fastest of 9 (scratch harness, two runs): 1 row
    26.0 / 25.3 -> 23.9 / 24.1 ms, 16 rows 45.1 / 43.8 -> 43.0 / 42.0 ms; 64 rows, bound by
    the FMAs, the same. Where the OS has no THP the advice is skipped: an ordinary mapping."""
    owners = [m for m in modules if m.panel_weight is not None]
    if not owners:
        return
    offsets, total = [], 0
    for m in owners:
        offsets.append(total)
        total += -(-m.panel_weight.nbytes // 64) * 64  # each panel set on a cache line
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without THP
            mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    arena = whole[skip : skip + total]
    for m, at in zip(owners, offsets, strict=True):
        panel = m.panel_weight.contiguous()
        moved = arena[at : at + panel.nbytes].view(panel.dtype).view(panel.shape)
        m.panel_weight = moved.copy_(panel)
