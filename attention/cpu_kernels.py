"""Compiled CPU kernels, built with the system C compiler at first use and called via ctypes.

`paged_decode_kernel()` returns the decode-attention kernel of `csrc/paged_decode.c` (read the
paged KV pool in place, one query token per request), or None when it cannot be built here
(no C compiler, a failed build, a non-x86 machine); the caller then keeps its torch path.

Build: `gcc -O3 -fopenmp -shared` with `-march=native`, or `-march=x86-64-v3` when
`ATEN_CPU_CAPABILITY=avx2` caps torch to AVX2 (so a capped run measures an AVX2 machine). The
library is cached under `$RADIXRT_CACHE_DIR` (default `~/.cache/radixrt`)/kernels, named by a
hash of the source, the flags, the compiler version and the CPU's flags, and written through
a temporary file and a rename so concurrent processes never load a half-written file. A build
takes about a second; later processes only load the file.

ctypes releases the GIL for the call, so the overlap loop's scheduler thread runs while a
forward is inside the kernel. The kernel's OpenMP threads come from the libgomp torch has
already loaded (same soname), with `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    root = os.environ.get("RADIXRT_CACHE_DIR") or Path.home() / ".cache" / "radixrt"
    return Path(root) / "kernels"


def _march() -> str:
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        return "-march=x86-64-v3"
    return "-march=native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(source: str) -> Path:
    """Compile csrc/`source` into a cached shared library; return its path.

    Raises RuntimeError naming the command and the compiler's output when the build fails.
    """
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    src = _CSRC / source
    flags = ["-O3", _march(), "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast"]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        "\0".join([src.read_text(), " ".join(flags), version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{src.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, *flags, str(src), "-o", str(built), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        os.replace(built, target)
    logger.info("Built CPU kernel %s", target)
    return target


class PagedDecodeKernel:
    """Decode attention over the paged pool: `__call__` returns float32 [B, H * D]."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.paged_decode_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, p, p, i32, i64, p, i64, p, p, i32, i32, i32, i32, ctypes.c_float, p, i32]
        fn.restype = i32
        self._fn = fn
        self._supports = library.paged_decode_supports
        self._supports.argtypes = [i32, i32, i32]
        self._supports.restype = i32

    def supports_shape(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel is specialised for this query group and head dim."""
        return bool(self._supports(num_heads, num_kv_heads, head_dim))

    @staticmethod
    def supports(kv_dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and kv_dtype in _KV_DTYPES

    def __call__(
        self,
        q: torch.Tensor,  # [B, H * D], any float dtype
        k_cache: torch.Tensor,  # [slots, Hkv, D], float32 or bfloat16
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,  # int32 [rows, max_context]
        pool_rows: torch.Tensor,  # int64 [B]
        seq_lens: torch.Tensor,  # int64 [B], the new token included
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:
        batch = q.shape[0]
        _, kv_heads, head_dim = k_cache.shape
        assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(2) == 1 and k_cache.stride(1) == head_dim
        assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
        q32 = q.reshape(batch, num_heads * head_dim).to(torch.float32).contiguous()
        pool_rows = pool_rows.to(torch.int64).contiguous()
        seq_lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty(batch, num_heads * head_dim, dtype=torch.float32)
        status = self._fn(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _KV_DTYPES[k_cache.dtype],
            k_cache.stride(0),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            pool_rows.data_ptr(),
            seq_lens.data_ptr(),
            batch,
            num_heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == 2:
            raise ValueError(
                f"paged decode attention: no kernel for {num_heads} query heads over "
                f"{kv_heads} KV heads of dim {head_dim}"
            )
        if status != 0:
            raise MemoryError("paged decode attention: scratch allocation failed")
        return out


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None (logged once, with why) where it cannot be built."""
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU decode kernel: not built on %s; torch path", platform.machine())
        return None
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(build_library("paged_decode.c"))))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU decode kernel unavailable, using the torch path: %s", exc)
        return None
