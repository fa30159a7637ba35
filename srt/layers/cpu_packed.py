"""Packed copies of the CPU linear weights (oneDNN, MKL, compiled panels), and which one runs
a matmul of how many rows.

`F.linear` on CPU calls MKL's sgemm on a plain `[out, in]` weight, which re-blocks the weight
on every call: at decode's small row counts that is most of the cost. So each weight is packed
once at load (`prepack_cpu_weights`) into the layout a library's kernel reads; `python -m
bench.bench_dtype --tokens 16 256 1024`, with and without `--prepacked`, measures what that
buys, and `python -m bench.bench_one_batch --batch-size 1 16 64`, with and without
`--disable-cpu-weight-prepack`, what it buys a step.

- Inputs of at most `SMALL_ROWS` rows (decode, one row per running request; small extends)
  run the compiled panels of `srt/kernels/csrc/packed_linear.c`: they stream each panel once
  at the FMA rate, where oneDNN's small-row kernels do not. In bfloat16 they multiply with
  `vdpbf16ps` or widen the weights to float32 FMAs, as the machine's measured plan says
  (`srt.kernels.linear.bf16_matmul_plan`).
- Larger float32 inputs (prefill) run whichever of oneDNN, MKL's packed sgemm and the panels
  `f32_matmul_plan` measured fastest on this machine: each wins on some CPU.
- Larger bfloat16 inputs run oneDNN, unless the bf16 plan found the widened panels faster at
  a prefill size (a CPU whose `vdpbf16ps` is slow and that has no AMX).

A layer holds its copies in a `PackedWeight` (None where not packed) beside the dense
parameter, which stays the source of truth (weight loading, tied embeddings, tests). The
panels cost one more copy of the weights; MKL's copy replaces oneDNN's, the panels need
none. Under tensor parallelism the dense parameter is this rank's shard, and the shard is
what gets packed. Packing is CPU-only and skipped for dtypes the CPU's oneDNN cannot run
(float16 without AVX512-FP16, bf16 without AVX512).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from srt import environ
from srt.kernels.build import cache_dir, cpu_flags, kept_plan, median_ms
from srt.kernels.linear import PackedLinearKernel, packed_linear_kernel

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
    timed once per machine and torch build (about a second) and the choice is kept under the
    kernel cache (`srt.kernels.build.kept_plan`), so every process runs the same kernels and a
    float32 output does not depend on which process computed it."""
    choice = environ.CPU_F32_MATMUL.get()  # raises for a value it does not name
    candidates = f32_libraries()
    if choice != "auto":
        if choice not in candidates:
            raise ValueError(f"RADIXRT_CPU_F32_MATMUL={choice}: not available on this machine")
        return F32MatmulPlan(choice, {})
    if len(candidates) == 1:
        return F32MatmulPlan(candidates[0], {})
    # What the kernels run on: the torch build (its MKL and oneDNN), the CPU, the ISA caps,
    # and the libraries compared.
    caps = environ.isa_caps()
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


@dataclass(slots=True, eq=False)
class PackedWeight:
    """The packed copies of one CPU linear weight: the compiled kernel's panels (`panels`,
    with `kernel`; None where the kernel cannot be built or take the dtype) run inputs up to
    `SMALL_ROWS` rows, and `large_rows` names what runs larger ones: "panels", or "onednn" /
    "mkl" with that library's copy in `library_weight`."""

    large_rows: str
    library_weight: torch.Tensor | None = None
    panels: torch.Tensor | None = None
    kernel: PackedLinearKernel | None = None

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight | None:
        """`weight`'s packed copies, or None where oneDNN has no CPU kernel for it."""
        if not can_pack(weight):
            return None
        kernel = packed_linear_kernel()  # None where it cannot be built
        panels = None
        if kernel is not None and kernel.accepts(weight):
            panels = kernel.pack(weight)
        else:
            kernel = None
        library = "onednn"
        if weight.dtype == torch.float32:
            library = f32_matmul_plan().library
        if library == "panels" and panels is None:
            library = "onednn"
        copy = None
        if library == "mkl":
            copy = mkl_pack_weight(weight)
        elif library == "onednn":
            copy = pack_weight(weight)
        return cls(library, copy, panels, kernel)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) for a CPU input of the weight's dtype."""
        kernel = self.kernel
        if kernel is not None and (
            self.large_rows == "panels"
            or x.numel() <= SMALL_ROWS * x.shape[-1]
            or kernel.runs_all_rows(x.dtype)
        ):
            return kernel(x, self.panels, weight.shape[0], bias)
        if self.large_rows == "mkl":
            return mkl_linear(x, self.library_weight, weight, bias)
        return packed_linear(x, self.library_weight, bias)


def apply_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | None,
) -> torch.Tensor:
    """x @ weight.T (+ bias): through `packed` for CPU inputs of the weight's dtype, else
    `F.linear` on the dense weight."""
    if packed is not None and not x.is_cuda and x.dtype == weight.dtype:
        return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Pack every linear weight of a CPU model (each module with a `pack_for_cpu()`: the
    linear layers, the LM head, the experts of a sparse MLP, which hold several and list
    them in `packed_weights()`); returns how many were packed. The panels then move into one
    arena (`panels_onto_huge_pages`)."""
    packed: list[PackedWeight] = []
    for m in model.modules():
        if hasattr(m, "pack_for_cpu") and m.pack_for_cpu():
            packed += m.packed_weights() if hasattr(m, "packed_weights") else [m.packed]
    logger.info("CPU weights: %d matmul weights prepacked", len(packed))
    panels_onto_huge_pages(packed)
    return len(packed)


def panels_onto_huge_pages(packed: list[Any]) -> None:
    """Move the panels of `packed` (each a `PackedWeight` or a
    `quantization.QuantizedWeight`: anything with a `panels` tensor), back to back, into one
    anonymous mapping advised for transparent huge
    pages (`MADV_HUGEPAGE`; Linux's default THP policy, `madvise`, gives them to such mappings
    only) and starting on a 2 MiB boundary. The panels' views keep the mapping alive.

    Every decode step streams all the panels, and with 4 KiB pages each page costs a TLB miss
    (a dear one in a VM, with nested page tables). One arena, not a mapping per weight: a
    mapping gets huge pages only for the whole 2 MiB-aligned ranges inside it, which a small
    weight never has. Small-row steps gain, FMA-bound ones do not (`python -m
    bench.bench_one_batch --batch-size 1 16 64` measures it). Where the OS has no THP the
    advice is skipped: an ordinary mapping."""
    owners = [p for p in packed if p.panels is not None]
    if not owners:
        return
    offsets, total = [], 0
    for p in owners:
        offsets.append(total)
        total += -(-p.panels.nbytes // 64) * 64  # each panel set on a cache line
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without THP
            mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    arena = whole[skip : skip + total]
    for p, at in zip(owners, offsets, strict=True):
        panel = p.panels.contiguous()
        moved = arena[at : at + panel.nbytes].view(panel.dtype).view(panel.shape)
        p.panels = moved.copy_(panel)
