"""Paged attention over the KV pool, read in place (`csrc/paged_decode.c`, `csrc/paged_extend.c`).

- `paged_decode_kernel()`: one query token per request; a prefix of KV slots that several
  requests hold, found once per step by `shared_prefixes()`, is read once for all of them.
- `paged_extend_kernel()`: many new tokens per request, causal over the cached prefix.

Both take a sliding-window layer's window (the positions a token sees, itself included) and
Gemma 2's score soft-capping.

Each returns None where the library cannot be built (`build.load`); `attention/cpu_backend.py`
then keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from srt.kernels.build import load

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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
        window: int | None,
        softcap: float | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Call the kernel with the arguments both share, around the int64 per-request arrays
        (pool rows first; None passes NULL); returns `out`, or raises for the kernel's error
        status. `window`: a sliding-window layer's (None: every earlier position);
        `softcap`: Gemma 2's score soft-capping (None: none)."""
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
            window or 0,
            softcap or 0.0,
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
    One call per decode step; every layer's kernel call reads the result.

    Rows of one request only (a speculative verify step's, one per draft position) form no
    group: each is then read as that request's own decode step reads it, in one pass, so a
    verify row computes what the decode step would, to the bit."""
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
        if rows[members].unique().numel() < 2:
            continue
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
            p, p, p, i32, i64, p, i64, p, p, p, p, i32, i32, i32, i32, ctypes.c_float, i64, ctypes.c_float, p, i32
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`shared`: requests whose leading KV slots are the same (`shared_prefixes`); their
        common prefix is read once per group. None: every request reads all its own.
        `window`: a sliding-window layer's; each request reads its last `window` tokens
        (and nothing is shared)."""
        batch, head_dim = q.shape[0], k_cache.shape[2]
        q32 = q.reshape(batch, num_heads * head_dim).to(torch.float32).contiguous()
        per_request = (
            pool_rows.to(torch.int64).contiguous(),
            seq_lens.to(torch.int64).contiguous(),
            None if shared is None else shared.leaders,
            None if shared is None else shared.lens,
        )
        out = torch.empty(batch, num_heads * head_dim, dtype=torch.float32)
        return self._run(
            q32, k_cache, v_cache, req_to_token, per_request, num_heads, scale, window, softcap, out
        )


class PagedExtendKernel(PagedAttentionKernel):
    """Extend attention over the paged pool, bottom-right causal over each request's prefix:
    `__call__` returns float32 [T, H * D], T = the sum of `extend_lens`."""

    _what = "paged extend attention"

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64, i32 = _P, _I64, _I32
        argtypes = [
            p, p, p, i32, i64, p, i64, p, p, p, i32, i32, i32, i32, ctypes.c_float, i64, ctypes.c_float, p, i32
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`window`: a sliding-window layer's; a token sees its last `window` positions.
        `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2)."""
        tokens, head_dim = q.shape[0], k_cache.shape[2]
        q32 = q.reshape(tokens, num_heads * head_dim).to(k_cache.dtype).float().contiguous()
        per_request = (pool_rows, prefix_lens, extend_lens)
        out = torch.empty(tokens, num_heads * head_dim, dtype=torch.float32)
        return self._run(
            q32, k_cache, v_cache, req_to_token, per_request, num_heads, scale, window, softcap, out
        )


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None (logged once, with why) where it cannot be built."""
    return load("paged_decode.c", PagedDecodeKernel, "CPU decode kernel")


@functools.cache
def paged_extend_kernel() -> PagedExtendKernel | None:
    """The compiled kernel, or None (logged once, with why) where it cannot be built."""
    return load("paged_extend.c", PagedExtendKernel, "CPU extend kernel")
