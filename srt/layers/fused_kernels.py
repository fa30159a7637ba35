"""Fused layer ops (RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE) for the layers, on CUDA
and on CPU.

On CUDA they come from one provider chosen once, lazily, on the first CUDA call. Providers, in
order of preference:

1. `sgl-kernel`, when `import sgl_kernel` succeeds AND one tiny `rmsnorm` call on the device
   works. A wheel built against another torch fails in odd ways: an `OSError` for an
   undefined symbol at import, a `RuntimeError` from the op registry, or only when an op
   runs. No sgl-kernel build matches torch 2.11 / 2.13, so this must fall back, not crash.
2. FlashInfer's ops (`flashinfer.norm.rmsnorm`, `flashinfer.norm.fused_add_rmsnorm`,
   `flashinfer.activation.silu_and_mul`, `flashinfer.rope.apply_rope_with_cos_sin_cache_inplace`),
   when `import flashinfer` succeeds and the same probe runs (it JIT-compiles its kernels,
   so a missing nvcc shows up here, not inside a forward).
3. torch: the layers' own code, which is also the numerical reference.

On CPU the same four ops come from `srt/kernels/layer_ops.py` (`layer_ops_kernel()`, C
compiled at first use) for float32 and bfloat16. They are handed to the modules of one model
by `enable_cpu_ops(model)` (the model runner calls it after loading, unless
`--disable-cpu-fused-ops`), not chosen per process: a module without them runs its torch code.

Both libraries expose the same four ops with the same semantics, so the layers call them
through one namespace: `rmsnorm(x, w, eps)` -> new tensor; `fused_add_rmsnorm(x, r, w, eps)`
in place (r += x, then x = rmsnorm(r)); `silu_and_mul(x)` -> new tensor (last dim *
itemsize a multiple of 16 bytes); `apply_rope_with_cos_sin_cache_inplace(positions, q, k,
head_size, cos_sin_cache, is_neox)` in place, float32 cache rows `[cos | sin]`.

Nothing GPU-side is imported at module import time: importing the model code never pulls
in a GPU package. One INFO line says which provider was chosen and why the others were not.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The kernels are instantiated for half types only; float32 models keep the torch code.
FUSED_DTYPES = (torch.float16, torch.bfloat16)
OP_NAMES = (
    "rmsnorm",
    "fused_add_rmsnorm",
    "silu_and_mul",
    "apply_rope_with_cos_sin_cache_inplace",
)
# The probe: one RMSNorm row wide enough for every kernel's vector width.
_PROBE_HIDDEN = 64


@dataclass(frozen=True, slots=True)
class FusedProvider:
    """The chosen provider: its name, its ops (None for torch), and why others were skipped."""

    name: str
    ops: Any | None
    skipped: tuple[str, ...] = ()

    def log_line(self) -> str:
        why = f" ({'; '.join(self.skipped)})" if self.skipped else ""
        return f"Fused ops: {self.name}{why}"


_lock = threading.Lock()
_provider: FusedProvider | None = None


def is_cuda(x: torch.Tensor) -> bool:
    """Whether `x` lives on a CUDA device (a seam: tests replace it to drive the GPU path)."""
    return x.is_cuda


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _probe(ops: Any, device: torch.device, dtype: torch.dtype) -> None:
    """One tiny RMSNorm on `device`; raises whatever a mismatched build raises."""
    x = torch.ones(1, _PROBE_HIDDEN, dtype=dtype, device=device)
    w = torch.ones(_PROBE_HIDDEN, dtype=dtype, device=device)
    out = ops.rmsnorm(x, w, 1e-6)
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)  # a launch failure surfaces here, not in a forward
    if tuple(out.shape) != (1, _PROBE_HIDDEN) or not bool((out.float() - 1).abs().max() < 1e-2):
        raise RuntimeError("rmsnorm probe: a row of ones did not normalise to ones")


def _load_sgl_kernel() -> Any:
    return importlib.import_module("sgl_kernel")


# Where each op lives in FlashInfer (0.7.x); a missing one is reported by name, not raised.
_FLASHINFER_OPS = {
    "rmsnorm": "flashinfer.norm",
    "fused_add_rmsnorm": "flashinfer.norm",
    "silu_and_mul": "flashinfer.activation",
    "apply_rope_with_cos_sin_cache_inplace": "flashinfer.rope",
}


def _load_flashinfer() -> Any:
    importlib.import_module("flashinfer")
    return SimpleNamespace(
        **{
            op: getattr(importlib.import_module(module), op, None)
            for op, module in _FLASHINFER_OPS.items()
        }
    )


# (log name, module name, loader); tried in this order.
_CANDIDATES = (
    ("sgl-kernel", "sgl_kernel", _load_sgl_kernel),
    ("flashinfer", "flashinfer", _load_flashinfer),
)


def select_provider(device: torch.device, dtype: torch.dtype) -> FusedProvider:
    """Try each candidate: import (any exception is a miss), check the four ops exist, and
    probe one op call on `device`. The first that passes wins; torch otherwise."""
    skipped: list[str] = []
    for name, module, load in _CANDIDATES:
        try:
            ops = load()
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == module:
                skipped.append(f"{name} not installed")
            else:
                skipped.append(f"{name} import failed: {_describe(exc)}")
            continue
        except Exception as exc:  # noqa: BLE001 - a broken build raises anything at import
            skipped.append(f"{name} import failed: {_describe(exc)}")
            continue
        missing = [op for op in OP_NAMES if not callable(getattr(ops, op, None))]
        if missing:
            skipped.append(f"{name} lacks {', '.join(missing)}")
            continue
        try:
            _probe(ops, device, dtype)
        except Exception as exc:  # noqa: BLE001 - an op of a mismatched build raises anything
            skipped.append(f"{name} probe failed: {_describe(exc)}")
            continue
        return FusedProvider(name, ops, tuple(skipped))
    return FusedProvider("torch", None, tuple(skipped))


def provider(device: torch.device, dtype: torch.dtype) -> FusedProvider:
    """The process's provider, chosen (and logged) on the first call."""
    global _provider
    chosen = _provider
    if chosen is None:
        with _lock:
            if _provider is None:
                _provider = select_provider(device, dtype)
                logger.info(_provider.log_line())
            chosen = _provider
    return chosen


def reset_provider() -> None:
    """Forget the choice, so the next CUDA call chooses again (tests)."""
    global _provider
    with _lock:
        _provider = None


def use_fused(x: torch.Tensor) -> bool:
    """Take the fused path for `x`? CUDA fp16/bf16 tensors, when a provider has the ops."""
    if not (x.dtype in FUSED_DTYPES and is_cuda(x)):
        return False
    return provider(x.device, x.dtype).ops is not None


def fused_ops() -> Any:
    """The chosen provider's ops; only valid after `use_fused` returned True."""
    chosen = _provider
    assert chosen is not None and chosen.ops is not None, "use_fused() must be True first"
    return chosen.ops


class CpuOpsUser:
    """Base of the modules that can run the compiled CPU layer ops: `cpu_ops` is set by
    `enable_cpu_ops` and stays None (the torch code) otherwise."""

    cpu_ops: Any | None = None


def cpu_ops_for(module: CpuOpsUser, *tensors: torch.Tensor) -> Any | None:
    """`module`'s CPU ops when it has them and they take `tensors`, else None."""
    ops = module.cpu_ops
    return ops if ops is not None and ops.accepts(*tensors) else None


def enable_cpu_ops(model: torch.nn.Module) -> int:
    """Give every `CpuOpsUser` of `model` the compiled CPU layer ops; returns how many got them
    (0, with a warning from the builder, where they cannot be built)."""
    from srt.kernels import layer_ops

    ops = layer_ops.layer_ops_kernel()
    users = [m for m in model.modules() if isinstance(m, CpuOpsUser)]
    for module in users:
        module.cpu_ops = ops
    count = len(users) if ops is not None else 0
    logger.info("CPU layer ops: %d modules run the compiled RMSNorm / SiLU-and-mul / RoPE", count)
    return count
