"""Prepacked CPU weights: same results as F.linear (oneDNN's copy, and the compiled panel
kernel that runs small inputs: float32, and bfloat16 through `vdpbf16ps` or widened to float32
FMAs, as the measured plan says), a fallback where oneDNN has no kernel, and the model runner
packs every matmul weight unless told not to."""

from __future__ import annotations

import contextlib
import json
import mmap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from srt.kernels import linear as kernels
from srt.kernels.linear import NEVER, Bf16MatmulPlan, packed_linear_kernel
from srt.layers import cpu_packed
from srt.layers.cpu_packed import (
    SMALL_ROWS,
    F32MatmulPlan,
    can_pack,
    f32_libraries,
    f32_matmul_plan,
    prepack_cpu_weights,
)
from srt.layers.linear import QKVLinear, ReplicatedLinear
from srt.layers.vocab_embedding import LMHead

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def initialised(module: torch.nn.Module) -> torch.nn.Module:
    """Layers are built with `torch.empty` weights (the loader fills them): give them values."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return module


@pytest.fixture(params=["onednn", "mkl", "panels"])
def f32_plan(request, monkeypatch):
    """Each library for float32 inputs past SMALL_ROWS rows in turn (the plan pinned)."""
    if request.param not in f32_libraries():
        pytest.skip(f"no {request.param} on this machine")
    monkeypatch.setenv("RADIXRT_CPU_F32_MATMUL", request.param)
    f32_matmul_plan.cache_clear()
    yield request.param
    f32_matmul_plan.cache_clear()


@pytest.mark.usefixtures("f32_plan")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 65, 300])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    if not can_pack(torch.empty(2, 2, dtype=dtype)):
        pytest.skip(f"no oneDNN {dtype} kernel on this CPU")
    torch.manual_seed(0)
    layer = initialised(ReplicatedLinear(48, 80, bias=True)).to(dtype)
    x = torch.randn(rows, 48).to(dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert layer.pack_for_cpu() and layer.packed is not None
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    # Leading dims are kept, and a strided view (a q/k/v split) is accepted.
    wide = torch.randn(3, 5, 96).to(dtype)[..., :48]
    torch.testing.assert_close(
        layer(wide).float(),
        F.linear(wide.float(), layer.weight.float(), layer.bias.float()),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )


def test_large_float32_inputs_take_the_planned_library(f32_plan: str, monkeypatch) -> None:
    """Up to SMALL_ROWS rows the panels, past them the plan's library; a second packed copy
    only for oneDNN and MKL."""
    if KERNEL is None:
        pytest.skip("no C compiler: the panel kernel cannot build")
    layer = initialised(ReplicatedLinear(48, 80, bias=True))
    assert layer.pack_for_cpu() and layer.packed.large_rows == f32_plan
    assert (layer.packed.library_weight is None) == (f32_plan == "panels")
    calls: list[str] = []
    for name in ("mkl_linear", "packed_linear"):  # spies around the real functions
        real = getattr(cpu_packed, name)
        monkeypatch.setattr(
            cpu_packed, name, lambda *a, name=name, real=real: calls.append(name) or real(*a)
        )
    panel_rows: list[int] = []
    layer.packed.kernel = CountingKernel(layer.packed.kernel, panel_rows)
    layer(torch.randn(SMALL_ROWS, 48))
    assert calls == [] and panel_rows == [SMALL_ROWS]
    layer(torch.randn(SMALL_ROWS + 1, 48))
    expected = {"mkl": ["mkl_linear"], "onednn": ["packed_linear"], "panels": []}[f32_plan]
    assert calls == expected
    assert panel_rows == [SMALL_ROWS] + ([SMALL_ROWS + 1] if f32_plan == "panels" else [])


@pytest.mark.skipif(len(f32_libraries()) < 2, reason="one float32 library: nothing to plan")
def test_f32_plan_is_measured_once_and_kept(tmp_path, monkeypatch) -> None:
    """`auto` times the libraries once and keeps the choice under the kernel cache; later
    processes (here, calls after clearing the cache of the function) read it back;
    `onednn` / `mkl` / `panels` pin it; other values fail."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RADIXRT_CPU_F32_MATMUL", "auto")
    measured: list[F32MatmulPlan] = []
    real = cpu_packed._measure_f32_plan
    monkeypatch.setattr(
        cpu_packed, "_measure_f32_plan", lambda libs: measured.append(real(libs)) or measured[-1]
    )
    libraries = f32_libraries()
    f32_matmul_plan.cache_clear()
    try:
        plan = f32_matmul_plan()
        assert measured == [plan] and plan.library in libraries
        assert {f"{lib}_{rows}" for lib in libraries for rows in (96, 384)} == set(plan.timings_ms)
        totals = {
            lib: plan.timings_ms[f"{lib}_96"] + plan.timings_ms[f"{lib}_384"] for lib in libraries
        }
        assert totals[plan.library] == min(totals.values())
        (saved,) = (tmp_path / "kernels").glob("f32-matmul-plan-*.json")
        assert json.loads(saved.read_text())["library"] == plan.library
        other = next(lib for lib in libraries if lib != plan.library)
        saved.write_text(json.dumps({"library": other, "timings_ms": {}}))
        f32_matmul_plan.cache_clear()
        assert f32_matmul_plan() == F32MatmulPlan(other, {})
        assert len(measured) == 1
        for value in libraries:
            monkeypatch.setenv("RADIXRT_CPU_F32_MATMUL", value)
            f32_matmul_plan.cache_clear()
            assert f32_matmul_plan() == F32MatmulPlan(value, {})
        monkeypatch.setenv("RADIXRT_CPU_F32_MATMUL", "fast")
        f32_matmul_plan.cache_clear()
        with pytest.raises(ValueError, match="auto, onednn, mkl, panels"):
            f32_matmul_plan()
    finally:
        f32_matmul_plan.cache_clear()


def test_unpackable_dtypes_keep_f_linear() -> None:
    layer = initialised(ReplicatedLinear(16, 8)).to(torch.float16)
    if can_pack(layer.weight):
        pytest.skip("this CPU's oneDNN runs float16")
    assert not layer.pack_for_cpu() and layer.packed is None
    x = torch.randn(4, 16).to(torch.float16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_input_of_another_dtype_takes_the_dense_weight() -> None:
    layer = initialised(ReplicatedLinear(16, 8))
    assert layer.pack_for_cpu()
    x = torch.randn(4, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # F.linear with a float32 weight: not silently packed
        layer(x)


def test_prepack_counts_linears_and_the_lm_head() -> None:
    model = torch.nn.ModuleDict(
        {"qkv": QKVLinear(32, 8, 4, 2), "o": ReplicatedLinear(32, 32), "head": LMHead(50, 32)}
    )
    initialised(model)
    assert prepack_cpu_weights(model) == 3
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model["head"](hidden), F.linear(hidden, model["head"].weight))


@pytest.mark.parametrize("disable", [False, True])
def test_model_runner_prepacks_unless_disabled(tmp_path, disable: bool) -> None:
    from managers.model_worker import ModelWorker
    from srt.server_args import ServerArgs
    from tests.engine.tiny_models import save_tiny_model

    folder = save_tiny_model("llama", tmp_path)
    args = ServerArgs(
        model_path=str(folder),
        dtype="float32",
        max_total_tokens=256,
        skip_tokenizer_init=True,
        disable_cpu_weight_prepack=disable,
    )
    model = ModelWorker(args).model_runner.model
    packed = [m.packed is not None for m in model.modules() if hasattr(m, "pack_for_cpu")]
    assert packed and all(p != disable for p in packed)


KERNEL = packed_linear_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel cannot build")
needs_bf16_kernel = pytest.mark.skipif(
    KERNEL is None or KERNEL.bf16_plan is None, reason="no AVX512_BF16: no bf16 panel kernel"
)
DOT, WIDEN = Bf16MatmulPlan(NEVER, False, {}), Bf16MatmulPlan(1, True, {})


@contextlib.contextmanager
def plan_in_use(plan: Bf16MatmulPlan):
    """The panel kernel runs bf16 inputs as `plan` says; the machine's plan after."""
    if KERNEL is None or KERNEL.bf16_plan is None:
        yield
        return
    saved = KERNEL.bf16_plan
    KERNEL.use_bf16_plan(plan)
    try:
        yield
    finally:
        KERNEL.use_bf16_plan(saved)


@pytest.fixture(params=["dot", "widen"])
def bf16_kernel(request):
    """Each bf16 panel kernel in turn (`vdpbf16ps`, widened)."""
    with plan_in_use(DOT if request.param == "dot" else WIDEN):
        yield request.param


class CountingKernel:
    """A test double around the real panel kernel: records the row count of each call."""

    def __init__(self, kernel, calls: list[int]) -> None:
        self.kernel, self.calls = kernel, calls

    def __call__(self, x, *args):
        self.calls.append(x.shape[0])
        return self.kernel(x, *args)

    def runs_all_rows(self, dtype):
        return self.kernel.runs_all_rows(dtype)


@needs_kernel
@pytest.mark.usefixtures("bf16_kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(80, 48), (33, 6), (100, 130), (64, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_kernel_matches_f_linear(dtype, out_features: int, in_features: int, with_bias):
    """Every row count through the register blocks and their tails (1..30 rows), a partial
    last panel (N not a multiple of the panel width), and more rows than one chunk; bfloat16
    (where the CPU has AVX512_BF16) against float32 math on the same bf16 values, rounded
    once."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    if not KERNEL.accepts(weight):
        pytest.skip(f"no {dtype} panel kernel on this CPU")
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    panels = KERNEL.pack(weight)
    assert panels.shape[0] == -(-out_features // KERNEL.panel)
    for rows in [*range(31), 1100]:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        got = KERNEL(x, panels, out_features, bias)
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.float(), expected.to(dtype).float(), atol=TOL[dtype], rtol=TOL[dtype]
        )


@needs_kernel
def test_odd_k_float32_only():
    """The bf16 kernel reads k in pairs: an odd K is not packed for it (oneDNN runs it)."""
    assert KERNEL.accepts(torch.empty(8, 7))
    assert not KERNEL.accepts(torch.empty(8, 7, dtype=torch.bfloat16))
    assert not KERNEL.accepts(torch.empty(8, 8, dtype=torch.float16))


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 13, 30, 64, 65, 1100])
def test_widened_bf16_equals_float32_panels_on_widened_inputs(rows: int) -> None:
    """The widened kernel is the float32 kernel on the bf16 values (same FMAs in the same
    order), rounded once: bit for bit, partial last panel and bias included."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(100, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(100, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    with plan_in_use(WIDEN):
        got = KERNEL(x, KERNEL.pack(weight), 100, bias)
    expected = KERNEL(x.float(), KERNEL.pack(weight.float()), 100, bias.float())
    assert torch.equal(got, expected.to(torch.bfloat16))


@needs_bf16_kernel
@pytest.mark.parametrize(("plan", "panel_rows"), [(DOT, [1, 64]), (WIDEN, [1, 64, 65])])
def test_large_bf16_inputs_take_the_panels_when_the_plan_says(plan, panel_rows) -> None:
    """Past SMALL_ROWS rows a bf16 layer runs oneDNN unless the plan found the widened kernel
    faster there; either way the result is F.linear's within bf16 rounding."""
    from srt.layers import cpu_packed

    layer = initialised(ReplicatedLinear(64, 80, bias=False)).to(torch.bfloat16)
    assert layer.pack_for_cpu()
    calls: list[int] = []
    layer.packed.kernel = CountingKernel(layer.packed.kernel, calls)
    with plan_in_use(plan):
        for rows in (1, cpu_packed.SMALL_ROWS, cpu_packed.SMALL_ROWS + 1):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            expected = F.linear(x.float(), layer.weight.float()).to(torch.bfloat16)
            torch.testing.assert_close(layer(x), expected, atol=2e-2, rtol=2e-2)
    assert calls == panel_rows


@needs_bf16_kernel
def test_bf16_plan_is_measured_once_and_kept(tmp_path, monkeypatch) -> None:
    """`auto` measures the plan and keeps it beside the library; the next process (here, the
    next call) reads it back instead of measuring; `dot` / `widen` pin it; other values fail."""
    monkeypatch.setenv("RADIXRT_CPU_BF16_MATMUL", "auto")
    library = tmp_path / "packed_linear-test.so"
    measured = kernels.bf16_matmul_plan(KERNEL, library)
    saved = tmp_path / "packed_linear-test.so.bf16-plan.json"
    assert json.loads(saved.read_text())["widen_from"] == measured.widen_from
    assert measured.widen_from in (*kernels._PLAN_ROWS, NEVER)
    assert {"dot_64", "widen_64", "widen_256"} <= measured.timings_ms.keys()
    saved.write_text(json.dumps({"widen_from": 3, "all_rows": False, "timings_ms": {}}))
    assert kernels.bf16_matmul_plan(KERNEL, library) == Bf16MatmulPlan(3, False, {})
    monkeypatch.setenv("RADIXRT_CPU_BF16_MATMUL", "dot")
    assert kernels.bf16_matmul_plan(KERNEL, library) == DOT
    monkeypatch.setenv("RADIXRT_CPU_BF16_MATMUL", "widen")
    assert kernels.bf16_matmul_plan(KERNEL, library) == WIDEN
    monkeypatch.setenv("RADIXRT_CPU_BF16_MATMUL", "fast")
    with pytest.raises(ValueError, match="auto, dot, widen"):
        kernels.bf16_matmul_plan(KERNEL, library)


@needs_bf16_kernel
def test_a_library_sharing_the_plan_follows_every_change() -> None:
    """The fused decode layer's library compiles these kernels in too: once it shares the
    panels' plan it gets the current threshold, and every later `use_bf16_plan` as well."""

    class Setter:  # stands in for the ctypes entry point: records the thresholds it gets
        def __init__(self) -> None:
            self.given: list[int] = []

        def __call__(self, rows: int) -> None:
            self.given.append(rows)

    class LibraryDouble:  # a test double for a ctypes library holding the bf16 kernels
        packed_linear_bf16_set_widen_from = Setter()

    other = LibraryDouble()
    given = other.packed_linear_bf16_set_widen_from.given
    KERNEL.share_bf16_plan(other)
    try:
        assert given == [KERNEL.bf16_plan.widen_from]
        with plan_in_use(DOT):
            assert given[-1] == NEVER
        assert given[-1] == KERNEL.bf16_plan.widen_from
    finally:
        KERNEL._widen_setters.remove(other.packed_linear_bf16_set_widen_from)


def vm_flags(address: int) -> set[str] | None:
    """The VmFlags of this process's mapping that holds `address` (None without smaps)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_kernel
def test_panels_move_into_one_huge_page_arena() -> None:
    """After prepacking, every panel weight lies back to back in one 2 MiB-aligned arena,
    advised for huge pages where the OS takes the advice, and the layers' outputs do not
    change."""
    model = torch.nn.ModuleDict(
        {"qkv": QKVLinear(32, 8, 4, 2), "o": ReplicatedLinear(32, 30), "head": LMHead(50, 32)}
    )
    initialised(model)
    hidden = torch.randn(3, 32)
    before = {name: layer.linear(hidden) for name, layer in model.items()}
    assert all(layer.packed is None for layer in model.values())
    prepack_cpu_weights(model)
    panels = [layer.packed.panels for layer in model.values()]
    assert all(panel is not None for panel in panels)
    start = panels[0].data_ptr()
    assert start % cpu_packed.HUGE_PAGE == 0
    offset = 0
    for panel in panels:
        assert panel.data_ptr() == start + offset and panel.is_contiguous()
        offset += -(-panel.nbytes // 64) * 64
    if hasattr(mmap, "MADV_HUGEPAGE") and (flags := vm_flags(start)) is not None:
        assert "hg" in flags
    for name, layer in model.items():
        torch.testing.assert_close(layer.linear(hidden), before[name], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.linear(hidden), F.linear(hidden, layer.weight, layer.bias))
