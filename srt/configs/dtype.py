"""Resolve ``--dtype`` (auto | float32 | bfloat16 | float16) to a torch dtype.

``auto`` rules, from ``python -m bench.bench_dtype`` on a CPU with avx512_bf16 (SmolLM2-135M's
linear shapes): bf16 is several times faster than fp32 for prefills, slightly faster for
single-token decode, and fp16 GEMMs run several times slower than fp32 (no native fp16 path).
Hence:

- CUDA: the config's dtype when it is fp16/bf16; a float32 (or missing) config -> bfloat16
  (float16 on GPUs without bf16).
- CPU: the config's dtype where the CPU runs it fast, i.e. a bfloat16 config on a CPU with
  native bf16 (``amx_bf16`` or ``avx512_bf16``); everything else -> float32 (fp16 has no
  fast CPU path; bf16 without native support is emulated; not measured on such a CPU yet).
  A GGUF model is dequantized to a float32 folder, so it runs float32 unless
  ``--dtype bfloat16`` is given.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from srt import environ

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_NAMED: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
_FAST_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) below which oneDNN runs no native bf16 kernel.
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni"}
)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 matmul instructions (AMX or AVX512-BF16) and oneDNN
    may use them: ``ONEDNN_MAX_CPU_ISA=AVX2`` (how the test suite emulates an AVX2-only CPU)
    makes bf16 matmuls as slow as on such a CPU, so ``auto`` must not pick bf16 then."""
    if environ.ONEDNN_MAX_CPU_ISA.get().lower() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    flags = cpu_flags()
    if flags:
        return bool(flags & _FAST_BF16_FLAGS)
    # No /proc/cpuinfo (e.g. macOS): fall back to what torch's dispatcher reports.
    return torch.backends.cpu.get_cpu_capability() == "AVX512_BF16"


def to_torch_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Normalise a config's ``dtype`` / ``torch_dtype`` value (str or torch.dtype)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.").lower()
    return _NAMED.get(name)


def resolve_dtype(dtype: str, config_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """The dtype to run in. See the module docstring for the ``auto`` rules."""
    name = dtype.lower()
    is_cuda = torch.device(device).type == "cuda"
    if name != "auto":
        if name not in _NAMED:
            raise ValueError(f"Unknown dtype {dtype!r}; choose one of {DTYPE_CHOICES}")
        resolved = _NAMED[name]
        if not is_cuda and resolved == torch.float16:
            logger.warning("float16 on CPU is much slower than float32 and bfloat16")
        return resolved
    if is_cuda:
        if config_dtype == torch.float16:
            return torch.float16
        bf16_ok = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_ok else torch.float16
    if config_dtype == torch.bfloat16 and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32
