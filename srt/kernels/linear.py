"""Linear layers against weights packed once at load (`csrc/packed_linear.c`).

`packed_linear_kernel()` gives `x @ W.T (+ bias)` for small row counts against panels made by
`PackedLinearKernel.pack`: float32, and bfloat16 where the CPU has AVX512_BF16
(`srt/layers/cpu_packed.py` packs the layers' weights and calls it). bfloat16 has two kernels
(`vdpbf16ps`, and float32 FMAs over widened weights); `bf16_matmul_plan` times them once per
machine and library and keeps the choice in `<library>.bf16-plan.json` beside it
(`RADIXRT_CPU_BF16_MATMUL=dot|widen` pins it), so every process on a machine runs the same
bf16 kernels. The same library has `greedy_logits`: a float32 LM head's logits through a bf16
copy, exact wherever a row's maximum can be (for greedy decoding; `LMHead.argmax_logits`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from srt import environ
from srt.kernels.build import has_contiguous_rows, kept_plan, load, median_ms

logger = logging.getLogger(__name__)

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class PackedLinearKernel:
    """`x @ W.T (+ bias)` against a weight packed once by `pack` (see `csrc/panels.h`:
    panels of `panel` output columns, K rows each): float32, and bfloat16 where the CPU has
    AVX512_BF16 (K even). `accepts(weight)` says whether a weight can be packed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, i32 = _P, _I64, _I32
        argtypes = [p, i64, p, p, i32, i32, i32, p, i64, i32]
        self._fns: dict[torch.dtype, Callable[..., int | None]] = {}
        for dtype, entry, restype in (
            (torch.float32, "packed_linear", None),
            (torch.bfloat16, "packed_linear_bf16", i32),
        ):
            fn = getattr(library, entry, None)  # the bf16 entry exists only with AVX512_BF16
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = restype
                self._fns[dtype] = fn
        panel = library.packed_linear_panel
        panel.restype = i32
        self.panel = int(panel())
        # Greedy logits through a bf16 copy of a float32 LM head (built with the bf16 kernels).
        self._screen = getattr(library, "greedy_screen_logits", None)
        if self._screen is not None:
            self._screen.argtypes = [p, i64, p, p, p, i32, i32, i32, i32, p, i32]
            self._screen.restype = i32
        self.bf16_plan: Bf16MatmulPlan | None = None
        # The widen threshold of every library holding these panels' bf16 kernels: this one,
        # and the fused decode layer's (decode_layer.c includes packed_linear.c).
        self._widen_setters: list[Callable[[int], None]] = []
        if torch.bfloat16 in self._fns:
            self._set_widen_from = self._widen_setter(library)
            self._widen_setters.append(self._set_widen_from)
            self.use_bf16_plan(bf16_matmul_plan(self, Path(library._name)))
            logger.info("CPU bf16 matmuls: %s", self.bf16_plan.describe())

    @staticmethod
    def _widen_setter(library: ctypes.CDLL) -> Callable[[int], None]:
        setter = library.packed_linear_bf16_set_widen_from
        setter.argtypes = [_I32]
        setter.restype = None
        return setter

    def share_bf16_plan(self, library: ctypes.CDLL) -> None:
        """Make `library`, which compiles packed_linear.c in too, run this plan now and
        whenever `use_bf16_plan` changes it, so both run the same bf16 kernels."""
        if self.bf16_plan is not None and hasattr(library, "packed_linear_bf16_set_widen_from"):
            setter = self._widen_setter(library)
            self._widen_setters.append(setter)
            setter(self.bf16_plan.widen_from)

    def use_bf16_plan(self, plan: Bf16MatmulPlan) -> None:
        """Run bfloat16 inputs as `plan` says (the widened kernel from `plan.widen_from` rows),
        in this library and every one that shares its plan."""
        for setter in self._widen_setters:
            setter(plan.widen_from)
        self.bf16_plan = plan

    def runs_all_rows(self, dtype: torch.dtype) -> bool:
        """Whether inputs of this dtype run the panels at every row count (bfloat16 where the
        widened kernel beat oneDNN at prefill sizes), not only small ones."""
        return dtype == torch.bfloat16 and self.bf16_plan is not None and self.bf16_plan.all_rows

    def accepts(self, weight: torch.Tensor) -> bool:
        """A dense 2-D CPU weight of a dtype the library was built for (bf16: K even)."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in self._fns:
            return False
        return weight.dtype == torch.float32 or weight.shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A dense `[N, K]` weight -> float32 `[ceil(N / panel), K, panel]`, or bfloat16
        `[ceil(N / panel), K / 2, panel, 2]` (pairs of k side by side); zero-padded."""
        assert self.accepts(weight)
        n, k = weight.shape
        panels = -(-n // self.panel)
        padded = torch.zeros(panels * self.panel, k, dtype=weight.dtype)
        padded[:n] = weight.detach()
        if weight.dtype == torch.float32:
            return padded.view(panels, self.panel, k).transpose(1, 2).contiguous()
        return padded.view(panels, self.panel, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(
        self,
        x: torch.Tensor,  # [..., K], the weight's dtype
        packed: torch.Tensor,  # from `pack`
        out_features: int,  # N
        bias: torch.Tensor | None = None,  # [N], the weight's dtype
    ) -> torch.Tensor:
        assert x.dtype == packed.dtype and x.dtype in self._fns
        k = x.shape[-1]
        assert packed.shape[1] * (packed.dim() - 2) == k  # bf16 panels hold K / 2 pairs
        rows = x.reshape(-1, k)
        if not has_contiguous_rows(rows):
            rows = rows.contiguous()
        if bias is not None:
            assert bias.dtype == x.dtype and bias.shape == (out_features,)
            bias = bias.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        status = self._fns[x.dtype](
            rows.data_ptr(),
            rows.stride(0),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            rows.shape[0],
            out_features,
            k,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status == 3:
            raise MemoryError(f"packed linear: no memory to widen {rows.shape[0]} x {k} rows")
        if status:
            raise ValueError(f"packed linear: no bfloat16 kernel for K = {k} (odd)")
        return out.view(*x.shape[:-1], out_features)

    @property
    def screens_greedy(self) -> bool:
        """Whether `greedy_logits` can run (the library has the bf16 panels)."""
        return self._screen is not None

    def greedy_logits(
        self,
        x: torch.Tensor,  # float32 [M, K], M <= 1024
        screen_panels: torch.Tensor,  # `pack(weight.bfloat16())`
        weight: torch.Tensor,  # the float32 weight [N, K], contiguous
        row_norms: torch.Tensor,  # float32 [N]: ||weight[v]||
        max_candidates: int,
    ) -> torch.Tensor | None:
        """float32 [M, N] logits whose every row has the maximum, at the same positions, that
        this kernel's float32 panels give for `x @ weight.T` (csrc/packed_linear.c,
        `greedy_screen_logits`: a bfloat16 estimate, the columns that can be the maximum
        recomputed in float32); the other values are estimates, fit only for an argmax. None
        when some row had more than `max_candidates` such columns or a non-finite value."""
        assert self._screen is not None and x.dtype == weight.dtype == torch.float32
        assert weight.is_contiguous() and row_norms.dtype == torch.float32
        rows = x if has_contiguous_rows(x) else x.contiguous()
        n, k = weight.shape
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        status = self._screen(
            rows.data_ptr(),
            rows.stride(0),
            screen_panels.data_ptr(),
            weight.data_ptr(),
            row_norms.data_ptr(),
            rows.shape[0],
            n,
            k,
            max_candidates,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == 2:
            raise ValueError(f"greedy logits: no bfloat16 kernel for K = {k} (odd)")
        return None if status else out


@dataclass(frozen=True)
class Bf16MatmulPlan:
    """Which kernel runs a bfloat16 matmul of how many rows on this CPU (csrc/packed_linear.c):
    `vdpbf16ps` below `widen_from` rows, the widened kernel (float32 FMAs over the same bf16
    panels) from there on; `all_rows`: inputs above `SMALL_ROWS` rows run the widened kernel
    too, not oneDNN. `timings_ms` holds what the choice was made from."""

    widen_from: int
    all_rows: bool
    timings_ms: dict[str, float]

    def describe(self) -> str:
        if self.widen_from >= NEVER:
            small = "vdpbf16ps at every row count"
        elif self.widen_from <= 1:
            small = "widened at every row count"
        else:
            small = f"vdpbf16ps below {self.widen_from} rows, widened from there"
        large = "widened" if self.all_rows else "oneDNN"
        timed = ", ".join(f"{k} {v:.3f} ms" for k, v in self.timings_ms.items())
        return f"{small}; over 64 rows: {large}" + (f" ({timed})" if timed else "")


NEVER = 1 << 30  # a row count no input reaches
_PLAN_ROWS = (1, 2, 4, 8, 16, 64)
_PLAN_LARGE_ROWS = 256


def _measure_bf16_plan(kernel: PackedLinearKernel) -> Bf16MatmulPlan:
    """Time `vdpbf16ps` against the widened kernel at decode row counts, and the widened
    kernel against oneDNN at a prefill size, on one [2048, 576] weight (a decode layer's
    shape, cache-resident: the kernels' compute rates are what differs)."""
    try:
        return _time_bf16_kernels(kernel)
    finally:  # the kernel runs as its plan says again (none yet: while it is being made)
        if kernel.bf16_plan is not None:
            kernel.use_bf16_plan(kernel.bf16_plan)


def _time_bf16_kernels(kernel: PackedLinearKernel) -> Bf16MatmulPlan:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(2048, 576, generator=gen) * 0.05).to(torch.bfloat16)
    panels = kernel.pack(weight)
    timings: dict[str, float] = {}

    def panels_ms(widen_from: int, x: torch.Tensor, reps: int = 7) -> float:
        kernel._set_widen_from(widen_from)
        return median_ms(lambda: kernel(x, panels, 2048), reps)

    widen_from = NEVER
    for rows in reversed(_PLAN_ROWS):  # the smallest row count from which widening wins
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        dot = timings[f"dot_{rows}"] = panels_ms(NEVER, x)
        widen = timings[f"widen_{rows}"] = panels_ms(1, x)
        if widen >= dot:
            break
        widen_from = rows
    x = torch.randn(_PLAN_LARGE_ROWS, 576, generator=gen).to(torch.bfloat16)
    widen = timings[f"widen_{_PLAN_LARGE_ROWS}"] = panels_ms(1, x, 5)
    all_rows = True
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        onednn = timings[f"onednn_{_PLAN_LARGE_ROWS}"] = median_ms(
            lambda: torch.ops.mkldnn._linear_pointwise(x, onednn_weight, None, "none", [], ""), 5
        )
        all_rows = widen < onednn
    return Bf16MatmulPlan(widen_from, all_rows, timings)


def bf16_matmul_plan(kernel: PackedLinearKernel, library: Path) -> Bf16MatmulPlan:
    """The bf16 plan for this machine: `RADIXRT_CPU_BF16_MATMUL=dot` (vdpbf16ps panels up to
    SMALL_ROWS rows, oneDNN above) or `widen` (the widened kernel at every row count) pin it;
    by default (`auto`) it is measured once per machine and library and kept beside the
    library (`<library>.bf16-plan.json`, written under a lock), so every process on a machine
    runs the same kernels and a bf16 output does not depend on which process computed it."""
    choice = environ.CPU_BF16_MATMUL.get()  # raises for a value other than these three
    if choice == "dot":
        return Bf16MatmulPlan(NEVER, False, {})
    if choice == "widen":
        return Bf16MatmulPlan(1, True, {})
    saved = library.with_name(library.name + ".bf16-plan.json")
    return kept_plan(saved, Bf16MatmulPlan, lambda: _measure_bf16_plan(kernel))


@functools.cache
def packed_linear_kernel() -> PackedLinearKernel | None:
    """The compiled linear kernel, or None (logged once, with why) where it cannot be built."""
    return load("packed_linear.c", PackedLinearKernel, "CPU packed linear")
