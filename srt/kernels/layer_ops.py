"""The elementwise layer ops of `csrc/layer_ops.c`: RMSNorm with the residual add fused,
SiLU-and-mul, RoPE, and a row argmax (greedy sampling).

They have the call signatures of the CUDA fused-op providers, so
`srt/layers/fused_kernels.py` hands them to the layers the same way; `layer_ops_kernel()` is
None where the library cannot be built (the layers keep their torch code).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from srt.kernels.build import has_contiguous_rows, load

_LAYER_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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
        assert all(has_contiguous_rows(t) for t in rows)
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
        if not has_contiguous_rows(rows):
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
        assert self.accepts(q, k) and has_contiguous_rows(q) and has_contiguous_rows(k)
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
        assert x.device.type == "cpu" and x.dtype == torch.float32 and has_contiguous_rows(x)
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
    return load("layer_ops.c", LayerOpsKernel, "CPU layer ops")
