"""How `fused_kernels` chooses its provider: sgl-kernel, else FlashInfer, else torch.

No GPU here: test doubles of `sgl_kernel` and `flashinfer` are injected through `sys.modules`
(or a package on `sys.path` whose import raises, as a wheel built for another torch does),
and `fused_kernels.is_cuda` is replaced so CPU half-precision tensors take the CUDA branch.
The doubles' ops are pure torch with the libraries' documented semantics, so the layers'
results are still checked against the torch path.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from srt.layers import fused_kernels
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm, rms_norm_native
from srt.layers.rotary_embedding import get_rope
from tests.srt.test_fused_kernels import _fake_sgl_kernel

LOGGER = fused_kernels.__name__
# The probe, then `_run_layers`: rmsnorm, fused_add_rmsnorm (the fake's own rmsnorm inside
# it records too), silu_and_mul and rope.
PROBE_AND_LAYERS = ["rmsnorm", "rmsnorm", "fused_add_rmsnorm", "rmsnorm", "silu_and_mul", "rope"]


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test chooses afresh, with neither real package reachable and CPU tensors
    treated as CUDA."""
    for name in ("sgl_kernel", "flashinfer", "flashinfer.norm"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` raises ModuleNotFoundError
    monkeypatch.setattr(fused_kernels, "is_cuda", lambda x: True)
    fused_kernels.reset_provider()
    yield
    fused_kernels.reset_provider()


def _install_sgl_kernel(monkeypatch: pytest.MonkeyPatch, fake: types.SimpleNamespace) -> None:
    module = types.ModuleType("sgl_kernel")
    module.__dict__.update(vars(fake))
    monkeypatch.setitem(sys.modules, "sgl_kernel", module)


def _install_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A `flashinfer` package with `norm`, `activation` and `rope` submodules; returns the
    list its ops append their names to."""
    fake = _fake_sgl_kernel()
    package = types.ModuleType("flashinfer")
    submodules = {
        "norm": ("rmsnorm", "fused_add_rmsnorm"),
        "activation": ("silu_and_mul",),
        "rope": ("apply_rope_with_cos_sin_cache_inplace",),
    }
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    for sub, ops in submodules.items():
        module = types.ModuleType(f"flashinfer.{sub}")
        for op in ops:
            setattr(module, op, getattr(fake, op))
        setattr(package, sub, module)
        monkeypatch.setitem(sys.modules, f"flashinfer.{sub}", module)
    return fake.calls


def _broken_sgl_kernel_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A real `sgl_kernel` package whose import fails like a wheel built for another torch."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise OSError("common_ops.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEab")\n'
    )
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    monkeypatch.syspath_prepend(str(tmp_path))


def _chosen(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Fused ops:")]


def _run_layers() -> None:
    """RMSNorm (plain and fused add), SiluAndMul and RoPE in bf16, each checked against the
    torch path (which the fakes must reproduce)."""
    norm = RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    x, res = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x), rms_norm_native(x, norm.weight, 1e-5))
    _, summed = norm(x.clone(), res.clone())
    torch.testing.assert_close(summed, x + res)
    gate_up = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:]
    torch.testing.assert_close(SiluAndMul()(gate_up), expected)
    rope = get_rope(16, 16, 64, 10000.0, None)
    q, k = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    rope(torch.tensor([0, 5, 9]), q, k)


def test_sgl_kernel_import_error_falls_back_to_flashinfer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _broken_sgl_kernel_on_path(monkeypatch, tmp_path)
    calls = _install_flashinfer(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run_layers()
    assert fused_kernels.provider(torch.device("cpu"), torch.bfloat16).name == "flashinfer"
    [line] = _chosen(caplog)
    assert line.startswith("Fused ops: flashinfer (sgl-kernel import failed: OSError: ")
    assert "undefined symbol" in line
    assert calls == PROBE_AND_LAYERS  # every layer ran on flashinfer


def test_sgl_kernel_whose_op_fails_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _fake_sgl_kernel()

    def rmsnorm(*_: object, **__: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: no kernel image is available for execution")

    fake.rmsnorm = rmsnorm
    _install_sgl_kernel(monkeypatch, fake)
    calls = _install_flashinfer(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run_layers()
    expected = (
        "Fused ops: flashinfer (sgl-kernel probe failed: RuntimeError: CUDA error: no kernel "
        "image is available for execution)"
    )
    assert _chosen(caplog) == [expected]
    assert fake.calls == [] and calls[0] == "rmsnorm"


def test_working_sgl_kernel_is_preferred(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _fake_sgl_kernel()
    _install_sgl_kernel(monkeypatch, fake)
    calls = _install_flashinfer(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run_layers()
    assert _chosen(caplog) == ["Fused ops: sgl-kernel"]
    assert fake.calls == PROBE_AND_LAYERS
    assert calls == []


def test_nothing_usable_keeps_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _broken_sgl_kernel_on_path(monkeypatch, tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run_layers()  # the torch code: its own reference
        _run_layers()
    [line] = _chosen(caplog)  # chosen and logged once
    assert line.startswith("Fused ops: torch (sgl-kernel import failed: OSError: ")
    assert line.endswith("; flashinfer not installed)")
    assert not fused_kernels.use_fused(torch.randn(2, 64, dtype=torch.bfloat16))


def test_flashinfer_missing_an_op_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _install_flashinfer(monkeypatch)
    del sys.modules["flashinfer.activation"].silu_and_mul
    with caplog.at_level(logging.INFO, logger=LOGGER):
        chosen = fused_kernels.provider(torch.device("cpu"), torch.bfloat16)
    assert chosen.name == "torch" and chosen.ops is None
    assert _chosen(caplog) == [
        "Fused ops: torch (sgl-kernel not installed; flashinfer lacks silu_and_mul)"
    ]


def test_chosen_once_and_only_for_half_precision_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _fake_sgl_kernel()
    _install_sgl_kernel(monkeypatch, fake)
    assert not fused_kernels.use_fused(torch.randn(2, 64))  # float32: torch, no choice made
    assert fused_kernels._provider is None
    for _ in range(3):
        assert fused_kernels.use_fused(torch.randn(2, 64, dtype=torch.float16))
    assert fake.calls == ["rmsnorm"]  # one probe, however many calls
    assert fused_kernels.fused_ops().rmsnorm is fake.rmsnorm
