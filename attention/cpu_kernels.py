"""Compiled CPU kernels, built with the system C compiler at first use and called via ctypes.

- `paged_decode_kernel()`: the decode-attention kernel of `csrc/paged_decode.c` (reads the
  paged KV pool in place, one query token per request; a prefix of KV slots that several
  requests hold, found by `shared_prefixes()`, is read once for all of them).
- `paged_extend_kernel()`: the extend-attention kernel of `csrc/paged_extend.c` (reads the
  pool in place too: many new tokens per request, causal over the cached prefix).
- `packed_linear_kernel()`: linear layers against a weight packed once at load (float32; bf16
  where the CPU has AVX512_BF16), for small row counts (`csrc/packed_linear.c`; used by
  `srt/layers/cpu_packed.py`). bf16 has two kernels (`vdpbf16ps`, and float32 FMAs over
  widened weights); `bf16_matmul_plan` times them once per machine and library and keeps
  the choice in `<library>.bf16-plan.json` beside it (`RADIXRT_CPU_BF16_MATMUL=dot|widen`
  pins it; `kept_plan` is that file-and-lock logic, which srt/layers/cpu_packed.py's float32
  plan uses too), so every process on a machine runs the same bf16 kernels. The same library
  has `greedy_logits`: a float32 LM head's logits through a bf16 copy, exact wherever a row's
  maximum can be (for greedy decoding; `LMHead.argmax_logits`).
- `decode_layer_kernel()`: one decoder layer of a decode step in one call (`csrc/decode_layer.c`,
  which includes the three sources above and runs their kernels in the layer's order).
- `layer_ops_kernel()`: the elementwise layer ops of `csrc/layer_ops.c` (RMSNorm with the
  residual add fused, SiLU-and-mul, RoPE), with the call signatures of the CUDA fused-op
  providers, so `srt/layers/fused_kernels.py` hands them to the layers the same way.

Each returns None when it cannot be built here (no C compiler, a failed build, a non-x86
machine); the caller then keeps its torch path. Every source includes `csrc/cpu_vec.h`.

Build: `gcc -O3 -fopenmp -shared` with `-march=native`, or `-march=x86-64-v3` when
`ATEN_CPU_CAPABILITY=avx2` caps torch to AVX2 (so a capped run measures an AVX2 machine). The
library is cached under `$RADIXRT_CACHE_DIR` (default `~/.cache/radixrt`)/kernels, named by a
hash of every csrc/ source and header, the flags, the compiler version and the CPU's flags, and
written through a temporary file and a rename so concurrent processes never load a
half-written file. A build takes a few seconds; later processes only load the file.

ctypes releases the GIL for the call, so the overlap loop's scheduler thread runs while a
forward is inside the kernel. The kernel's OpenMP threads come from the libgomp torch has
already loaded (same soname), with `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
T = TypeVar("T")
P = TypeVar("P")  # a plan dataclass (`kept_plan`)
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    root = os.environ.get("RADIXRT_CACHE_DIR") or Path.home() / ".cache" / "radixrt"
    return Path(root) / "kernels"


def _march() -> str:
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        return "-march=x86-64-v3"
    return "-march=native"


def cpu_flags() -> str:
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
    # Every source and header: a source may include another (decode_layer.c does).
    sources = [f.read_text() for f in sorted(_CSRC.glob("*.[ch]"))]
    key = hashlib.sha256(
        "\0".join([src.name, *sources, " ".join(flags), version, cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{src.stem}-{key}.so"
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


class PagedAttentionKernel:
    """What the paged-pool kernels share: the shape rule their library exports
    (`<entry>_supports`), the KV dtypes they read, and a call's common arguments, checks and
    status codes (`_run`)."""

    _what: str

    def __init__(self, library: ctypes.CDLL, entry: str, argtypes: list) -> None:
        fn = getattr(library, entry)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        self._fn = fn
        self._supports = getattr(library, f"{entry.removesuffix('_attention')}_supports")
        self._supports.argtypes = [ctypes.c_int] * 3
        self._supports.restype = ctypes.c_int

    def supports_shape(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel is specialised for this query group and head dim."""
        return bool(self._supports(num_heads, num_kv_heads, head_dim))

    @staticmethod
    def supports(kv_dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and kv_dtype in _KV_DTYPES

    def _run(
        self,
        q32: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        per_request: tuple[torch.Tensor | None, ...],
        num_heads: int,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Call the kernel with the arguments both share, around the int64 per-request arrays
        (pool rows first; None passes NULL); returns `out`, or raises for the kernel's error
        status."""
        _, kv_heads, head_dim = k_cache.shape
        assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(2) == 1 and k_cache.stride(1) == head_dim
        assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
        assert all(t is None or t.dtype == torch.int64 and t.is_contiguous() for t in per_request)
        status = self._fn(
            q32.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _KV_DTYPES[k_cache.dtype],
            k_cache.stride(0),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            *(None if t is None else t.data_ptr() for t in per_request),
            per_request[0].shape[0],
            num_heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == 2:
            raise ValueError(
                f"{self._what}: no kernel for {num_heads} query heads over "
                f"{kv_heads} KV heads of dim {head_dim}"
            )
        if status != 0:
            raise MemoryError(f"{self._what}: scratch allocation failed")
        return out


_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


# A group's common prefix is read once per step only when it is at least this long: shorter
# ones cost their own chunk items and merges for little memory saved.
MIN_SHARED_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """Which requests of a decode batch hold the same leading KV slots, for the decode kernel.

    With the radix cache, requests that matched the same cached prefix hold the same slots for
    it (one slot per token, written once), so the kernel can read those K/V rows once for all
    of them. `leaders[b]`: the first request of b's group (b itself when b shares nothing);
    `lens[b]`: the group's common prefix in tokens (0 when b shares nothing). int64 [B].
    """

    leaders: torch.Tensor
    lens: torch.Tensor

    @property
    def groups(self) -> int:
        """Groups that share a prefix (for logs and tests)."""
        return int(((self.leaders == torch.arange(len(self.leaders))) & (self.lens > 0)).sum())


def shared_prefixes(
    req_to_token: torch.Tensor,
    pool_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    min_tokens: int = MIN_SHARED_TOKENS,
) -> SharedPrefixes | None:
    """Group a decode batch's requests by the KV slot of their first token, and give each group
    the longest prefix of slots all its members hold (the newest token, each request's own,
    excluded). Groups sharing fewer than `min_tokens` are left out; None when no group is left.
    One call per decode step; every layer's kernel call reads the result."""
    batch = pool_rows.numel()
    if batch < 2:
        return None
    rows = pool_rows.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    first = req_to_token[rows, 0]
    _, group_of, sizes = torch.unique(first, return_inverse=True, return_counts=True)
    if int(sizes.max()) < 2:
        return None
    leaders = torch.arange(batch, dtype=torch.int64)
    shared = torch.zeros(batch, dtype=torch.int64)
    for group in torch.nonzero(sizes >= 2).flatten().tolist():
        members = torch.nonzero(group_of == group).flatten()
        span = int(lens[members].min()) - 1
        if span < min_tokens:
            continue
        slots = req_to_token[rows[members], :span]
        common = int((slots == slots[0]).all(dim=0).to(torch.int32).cumprod(0).sum())
        if common >= min_tokens:
            leaders[members] = members[0]
            shared[members] = common
    if not bool((shared > 0).any()):
        return None
    return SharedPrefixes(leaders, shared)


class PagedDecodeKernel(PagedAttentionKernel):
    """Decode attention over the paged pool: `__call__` returns float32 [B, H * D]."""

    _what = "paged decode attention"

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, i32 = _P, _I64, _I32
        argtypes = [
            p, p, p, i32, i64, p, i64, p, p, p, p, i32, i32, i32, i32, ctypes.c_float, p, i32
        ]  # fmt: skip
        super().__init__(library, "paged_decode_attention", argtypes)

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
        shared: SharedPrefixes | None = None,
    ) -> torch.Tensor:
        """`shared`: requests whose leading KV slots are the same (`shared_prefixes`); their
        common prefix is read once per group. None: every request reads all its own."""
        batch, head_dim = q.shape[0], k_cache.shape[2]
        q32 = q.reshape(batch, num_heads * head_dim).to(torch.float32).contiguous()
        per_request = (
            pool_rows.to(torch.int64).contiguous(),
            seq_lens.to(torch.int64).contiguous(),
            None if shared is None else shared.leaders,
            None if shared is None else shared.lens,
        )
        out = torch.empty(batch, num_heads * head_dim, dtype=torch.float32)
        return self._run(q32, k_cache, v_cache, req_to_token, per_request, num_heads, scale, out)


class PagedExtendKernel(PagedAttentionKernel):
    """Extend attention over the paged pool, bottom-right causal over each request's prefix:
    `__call__` returns float32 [T, H * D], T = the sum of `extend_lens`."""

    _what = "paged extend attention"

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, i32 = _P, _I64, _I32
        argtypes = [
            p, p, p, i32, i64, p, i64, p, p, p, i32, i32, i32, i32, ctypes.c_float, p, i32
        ]  # fmt: skip
        super().__init__(library, "paged_extend_attention", argtypes)

    def __call__(
        self,
        q: torch.Tensor,  # [T, H * D]; rounded to the KV dtype first, as torch_native does
        k_cache: torch.Tensor,  # [slots, Hkv, D], float32 or bfloat16
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,  # int32 [rows, max_context]
        pool_rows: torch.Tensor,  # int64 [B], contiguous
        prefix_lens: torch.Tensor,  # int64 [B], contiguous
        extend_lens: torch.Tensor,  # int64 [B], contiguous; sums to T
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:
        tokens, head_dim = q.shape[0], k_cache.shape[2]
        q32 = q.reshape(tokens, num_heads * head_dim).to(k_cache.dtype).float().contiguous()
        per_request = (pool_rows, prefix_lens, extend_lens)
        out = torch.empty(tokens, num_heads * head_dim, dtype=torch.float32)
        return self._run(q32, k_cache, v_cache, req_to_token, per_request, num_heads, scale, out)


def _load(source: str, wrapper: Callable[[ctypes.CDLL], T], what: str) -> T | None:
    """`wrapper` around the library built from csrc/`source`, or None (logged, with why)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.info("%s: not built on %s; torch path", what, platform.machine())
        return None
    try:
        return wrapper(ctypes.CDLL(str(build_library(source))))
    except (OSError, RuntimeError) as exc:
        logger.warning("%s unavailable, using the torch path: %s", what, exc)
        return None


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None (logged once, with why) where it cannot be built."""
    return _load("paged_decode.c", PagedDecodeKernel, "CPU decode kernel")


@functools.cache
def paged_extend_kernel() -> PagedExtendKernel | None:
    """The compiled kernel, or None (logged once, with why) where it cannot be built."""
    return _load("paged_extend.c", PagedExtendKernel, "CPU extend kernel")


class PackedLinearKernel:
    """`x @ W.T (+ bias)` against a weight packed once by `pack` (see `csrc/packed_linear.c`:
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
        if not _rows(rows):
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
        rows = x if _rows(x) else x.contiguous()
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


def median_ms(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1000


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
    choice = os.environ.get("RADIXRT_CPU_BF16_MATMUL", "auto").lower()
    if choice == "dot":
        return Bf16MatmulPlan(NEVER, False, {})
    if choice == "widen":
        return Bf16MatmulPlan(1, True, {})
    if choice != "auto":
        raise ValueError(f"RADIXRT_CPU_BF16_MATMUL={choice!r}: expected auto, dot or widen")
    saved = library.with_name(library.name + ".bf16-plan.json")
    return kept_plan(saved, Bf16MatmulPlan, lambda: _measure_bf16_plan(kernel))


def kept_plan(saved: Path, cls: type[P], measure: Callable[[], P]) -> P:
    """The plan saved in `saved` (JSON of a dataclass `cls`), or `measure()`'s, saved there
    first: made once per file, under a lock beside it, so that every process on a machine
    reads the same plan. An unreadable file is measured again and replaced."""
    saved.parent.mkdir(parents=True, exist_ok=True)
    with open(saved.with_name(saved.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return cls(**json.loads(saved.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        plan = measure()
        tmp = saved.with_name(saved.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(plan)))
        os.replace(tmp, saved)
    return plan


def _decode_layer(library: ctypes.CDLL) -> Callable[..., int]:
    panels = packed_linear_kernel()
    if panels is not None:
        panels.share_bf16_plan(library)  # its own copy of the panels' bf16 kernels
    fn = library.decode_layer
    fn.argtypes = [ctypes.c_void_p] * 5
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def decode_layer_kernel() -> Callable[..., int] | None:
    """`decode_layer` of csrc/decode_layer.c (one decoder layer of a decode step; called by
    srt/layers/cpu_decode_layer.py), or None where it cannot be built."""
    return _load("decode_layer.c", _decode_layer, "CPU fused decode layer")


@functools.cache
def packed_linear_kernel() -> PackedLinearKernel | None:
    """The compiled linear kernel, or None (logged once, with why) where it cannot be built."""
    return _load("packed_linear.c", PackedLinearKernel, "CPU packed linear")


_LAYER_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _rows(x: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1


class LayerOpsKernel:
    """The ops of `csrc/layer_ops.c` for CPU float32 / bfloat16 tensors, with the semantics of
    the CUDA providers' ops (see `srt/layers/fused_kernels.py`): `rmsnorm` returns a new
    tensor, `fused_add_rmsnorm` works in place, `silu_and_mul` returns a new tensor,
    `apply_rope_with_cos_sin_cache_inplace` rotates q and k in place. The ops take 2-D tensors
    whose rows are contiguous (any row stride); `silu_and_mul` also takes more leading dims.
    `accepts(*tensors)` says whether the tensors are CPU tensors of one dtype the kernels
    have: float32 or bfloat16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = library.rmsnorm_rows
        self._norm.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, i32, f32, i32]
        self._norm.restype = None
        self._silu = library.silu_and_mul_rows
        self._silu.argtypes = [p, i64, p, i64, i64, i64, i32, i32]
        self._silu.restype = None
        self._rope = library.rope_rows
        self._rope.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, i64, i64, i64, i32, i32, i32]
        self._rope.restype = i32
        self._argmax = library.argmax_rows
        self._argmax.argtypes = [p, i64, i64, i64, p, i32]
        self._argmax.restype = None

    @staticmethod
    def accepts(*tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return dtype in _LAYER_DTYPES and all(
            t.device.type == "cpu" and t.dtype == dtype for t in tensors
        )

    def _run_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        rows = (x, out) if residual is None else (x, out, residual)
        assert self.accepts(weight, *rows) and weight.is_contiguous()
        assert all(_rows(t) for t in rows)
        self._norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            x.shape[1],
            _LAYER_DTYPES[x.dtype],
            eps,
            torch.get_num_threads(),
        )

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, hidden] -> a new normed tensor."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._run_norm(x, None, weight, out, eps)
        return out

    def fused_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: residual += x, then x = rmsnorm(residual)."""
        self._run_norm(x, residual, weight, x, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
        assert self.accepts(x) and x.shape[-1] % 2 == 0
        rows = x.reshape(-1, x.shape[-1])
        if not _rows(rows):
            rows = rows.contiguous()
        inter = x.shape[-1] // 2
        out = torch.empty(rows.shape[0], inter, dtype=x.dtype)
        self._silu(
            rows.data_ptr(),
            rows.stride(0),
            out.data_ptr(),
            out.stride(0),
            rows.shape[0],
            inter,
            _LAYER_DTYPES[x.dtype],
            torch.get_num_threads(),
        )
        return out.view(*x.shape[:-1], inter)

    def apply_rope_with_cos_sin_cache_inplace(
        self,
        positions: torch.Tensor,  # int64 [T]
        q: torch.Tensor,  # [T, Hq * head_size]
        k: torch.Tensor,  # [T, Hk * head_size]
        head_size: int,
        cos_sin_cache: torch.Tensor,  # float32 [max_position, rot]: [cos | sin]
        is_neox: bool,
    ) -> None:
        assert self.accepts(q, k) and _rows(q) and _rows(k)
        assert q.shape[0] == k.shape[0] == positions.shape[0]
        assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
        positions = positions.to(torch.int64).contiguous()
        status = self._rope(
            q.data_ptr(),
            q.stride(0),
            q.shape[1] // head_size,
            k.data_ptr(),
            k.stride(0),
            k.shape[1] // head_size,
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0],
            q.shape[0],
            head_size,
            cos_sin_cache.shape[1],
            int(is_neox),
            _LAYER_DTYPES[q.dtype],
            torch.get_num_threads(),
        )
        if status != 0:
            raise IndexError(
                f"rotary embedding: a position is outside the cache's {cos_sin_cache.shape[0]} rows"
            )

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`torch.argmax(x, dim=-1)` of a 2-D float32 CPU tensor with contiguous rows: int64
        [rows], the first index of each row's maximum (of its first NaN, if any)."""
        assert x.device.type == "cpu" and x.dtype == torch.float32 and _rows(x)
        if x.shape[1] == 0:
            raise IndexError("argmax of an empty row")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


@functools.cache
def layer_ops_kernel() -> LayerOpsKernel | None:
    """The compiled layer ops, or None (logged once, with why) where they cannot be built."""
    return _load("layer_ops.c", LayerOpsKernel, "CPU layer ops")
