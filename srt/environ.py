"""Every environment variable RadixRT reads, in one typed module.

Settings belong in `ServerArgs` (one dataclass, one flag each); the environment is only for
what must reach code that has no `ServerArgs` in hand (the kernel cache, per-machine matmul
plans) or what a secret should not be written into (the API key). Each accessor reads the
environment when called, so a test's `monkeypatch.setenv` takes effect and a child process
sees what its parent set.

RadixRT's own variables:

| variable | default | read by |
|---|---|---|
| `RADIXRT_CACHE_DIR` | `~/.cache/radixrt` | compiled kernels, matmul plans, GGUF conversions, config snapshots |
| `RADIXRT_API_KEY` | unset | the key every route but `/health` requires (after `--api-key`) |
| `RADIXRT_CPU_F32_MATMUL` | `auto` | float32 CPU matmuls: `auto`, `onednn`, `mkl`, `panels` |
| `RADIXRT_CPU_BF16_MATMUL` | `auto` | bfloat16 CPU matmuls: `auto`, `dot`, `widen` |
| `RADIXRT_TEST_HANG_AT_FORWARD` | `0` | test hook: the N-th forward never returns (watchdog test) |
| `RADIXRT_TEST_SERVER_EXTRA_ARGS` | empty | the suite: flags added to its shared server (`--tp-size 2`) |

Other programs' variables RadixRT also honours: `CC` (the C compiler for the CPU kernels),
`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA` and `MKL_ENABLE_INSTRUCTIONS` (how the suite
emulates an AVX2-only CPU: kernels, plans and `--dtype auto` follow the cap), and
`OMP_NUM_THREADS` (where set, CPU tensor-parallel ranks keep it instead of splitting the cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its name, its default and the values it accepts (empty: any)."""

    name: str
    default: str = ""
    choices: tuple[str, ...] = ()

    def get(self) -> str:
        value = os.environ.get(self.name, "").strip() or self.default
        if self.choices:
            value = value.lower()
            if value not in self.choices:
                expected = ", ".join(self.choices)
                raise ValueError(f"{self.name}={value!r}: expected one of {expected}")
        return value

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


CACHE_DIR = EnvVar("RADIXRT_CACHE_DIR")
API_KEY = EnvVar("RADIXRT_API_KEY")
CPU_F32_MATMUL = EnvVar("RADIXRT_CPU_F32_MATMUL", "auto", ("auto", "onednn", "mkl", "panels"))
CPU_BF16_MATMUL = EnvVar("RADIXRT_CPU_BF16_MATMUL", "auto", ("auto", "dot", "widen"))
TEST_HANG_AT_FORWARD = EnvVar("RADIXRT_TEST_HANG_AT_FORWARD", "0")
TEST_SERVER_EXTRA_ARGS = EnvVar("RADIXRT_TEST_SERVER_EXTRA_ARGS")

C_COMPILER = EnvVar("CC", "gcc")
ATEN_CPU_CAPABILITY = EnvVar("ATEN_CPU_CAPABILITY")
ONEDNN_MAX_CPU_ISA = EnvVar("ONEDNN_MAX_CPU_ISA")
MKL_ENABLE_INSTRUCTIONS = EnvVar("MKL_ENABLE_INSTRUCTIONS")
OMP_NUM_THREADS = EnvVar("OMP_NUM_THREADS")


def cache_root() -> Path:
    """Where RadixRT keeps what it builds or converts: `$RADIXRT_CACHE_DIR`, else
    `~/.cache/radixrt`."""
    value = CACHE_DIR.get()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "radixrt"


def api_key() -> str | None:
    return API_KEY.get() or None


def hang_at_forward() -> int:
    """The 1-based forward that never returns (0: none); a test hook, not a setting."""
    value = TEST_HANG_AT_FORWARD.get()
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"{TEST_HANG_AT_FORWARD.name}={value!r}: expected an integer") from e


def isa_caps() -> tuple[str, str]:
    """The MKL and oneDNN instruction-set caps, as set (empty where not): part of the key of
    every measured matmul plan, since a capped library runs other kernels."""
    return MKL_ENABLE_INSTRUCTIONS.get(), ONEDNN_MAX_CPU_ISA.get()


def cpu_capped_to_avx2() -> bool:
    """True where ATen is capped to AVX2 (`ATEN_CPU_CAPABILITY=avx2`): the compiled kernels
    then target x86-64-v3 instead of the host's full instruction set."""
    return ATEN_CPU_CAPABILITY.get().lower() == "avx2"
