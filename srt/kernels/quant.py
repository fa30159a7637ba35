"""Linear layers against weights kept quantized (`csrc/quant_linear.c`): GGUF's Q4_0, Q4_1
and Q8_0 blocks, or a float weight quantized at load to the same forms.

A quantized weight is held as `QuantBlocks`: per output row and block of 32 weights along K,
unsigned integers `u` with a float16 scale `d` and offset `m` (w = d u + m). `from_gguf` reads
GGUF's raw blocks into that form without rounding anything; `quantize` makes it from a float
weight (`int8` / `int4`: a scale and a minimum per block, like Q4_1).
`QuantLinearKernel.pack` lays it out in the kernel's panels, and the kernel multiplies the
input, quantized per row and block to int8 as llama.cpp does, in integers
(`reference_linear` is the same arithmetic in torch, for tests).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from srt.kernels.build import has_contiguous_rows, load

QK = 32  # weights per block along K
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# GGUF block types kept quantized: bytes per block of 32 weights, and the bits of `u`.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "int4": 4, "int8": 8}


@dataclass(eq=False)
class QuantBlocks:
    """A `[N, K]` weight as blocks of 32 along K: u [N, K] uint8 (< 2^bits), d and m
    [N, K / 32] float16; the weight is d u + m, each block with its own d and m. `kind` names
    where it came from (a GGUF type, or `int8` / `int4`)."""

    kind: str
    u: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def bits(self) -> int:
        return BITS[self.kind]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        blocks = self.u.view(n, k // QK, QK).float()
        w = blocks * self.d.float()[..., None] + self.m.float()[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor | slice) -> QuantBlocks:
        """Some output rows (a tensor-parallel cut, or a reordering)."""
        return self.map_rows(lambda t: t[index])

    def map_rows(self, cut: Callable[[torch.Tensor], torch.Tensor]) -> QuantBlocks:
        """`cut` applied to u, d and m: any cut of rows (dim 0), such as a parameter's
        tensor-parallel `tp_take` of the weight it holds."""
        return QuantBlocks(self.kind, cut(self.u), cut(self.d), cut(self.m))

    def columns(self, start: int, end: int) -> QuantBlocks:
        """Input columns [start, end), both on a block boundary (a row-parallel cut)."""
        if start % QK or end % QK:
            raise ValueError(f"columns [{start}, {end}) do not fall on blocks of {QK}")
        b0, b1 = start // QK, end // QK
        return QuantBlocks(self.kind, self.u[:, start:end], self.d[:, b0:b1], self.m[:, b0:b1])

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks:
        """Weights of one kind stacked on the output dim (q, k and v; gate and up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights of different kinds {sorted(kinds)}")
        return QuantBlocks(
            parts[0].kind,
            torch.cat([p.u for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )


def from_gguf(kind: str, raw: torch.Tensor, n: int, k: int) -> QuantBlocks:
    """GGUF blocks (`raw`: uint8, n rows of k / 32 blocks of `GGUF_BLOCK_BYTES[kind]`) as
    `QuantBlocks`, exactly: Q4_0 is u = q, m = -8 d; Q8_0 is u = q + 128, m = -128 d (a
    power-of-two multiple of a float16 is a float16)."""
    size = GGUF_BLOCK_BYTES[kind]
    blocks = raw.reshape(n, k // QK, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if kind == "Q8_0":
        u = blocks[..., 2:].contiguous().view(n, k) ^ 128  # q + 128, as a byte
        return QuantBlocks(kind, u, d, d * -128)
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        qs = blocks[..., 4:]
    else:
        m = d * -8
        qs = blocks[..., 2:]
    # byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble)
    u = torch.empty(n, k // QK, 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 15, out=u[:, :, 0])
    torch.bitwise_right_shift(qs, 4, out=u[:, :, 1])
    return QuantBlocks(kind, u.view(n, k), d, m.contiguous())


def quantize(weight: torch.Tensor, kind: str) -> QuantBlocks:
    """A float `[N, K]` weight quantized per block of 32 along K (K a multiple of 32), with a
    scale and a minimum per block (as Q4_1): d = (max - min) / top, m = min,
    u = round((w - m) / d), top 255 for `int8` and 15 for `int4`. d and m are rounded to
    float16 first, u computed from the rounded ones. (Q8_0's symmetric blocks, d = max |w| /
    127, have twice the step wherever a block's values are not centred on zero.)"""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"K = {k} is not a multiple of {QK}")
    w = weight.detach().float().reshape(n, k // QK, QK)
    if kind not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {kind!r} (int8 or int4)")
    top = 255 if kind == "int8" else 15
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = ((hi - lo) / top).half(), lo.half()
    scale = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    u = torch.round((w - m.float()[..., None]) / scale[..., None]).clamp(0, top).to(torch.uint8)
    return QuantBlocks(kind, u.reshape(n, k), d, m)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it: per row and block of 32, dx = max |x| / 127 and
    xq = round(x / dx) (ties to even); returns (xq as float32 [M, K], dx [M, K / 32])."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    dx = xb.abs().amax(-1) / 127
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    xq = torch.where(dx[..., None] > 0, torch.round(xb / safe[..., None]), torch.zeros_like(xb))
    return xq.reshape(m, k), dx


def reference_linear(
    x: torch.Tensor, weight: QuantBlocks, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `QuantLinearKernel` computes, in float64 torch: the dequantized weight times the
    dequantized int8 rows of x (float32 out)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, dx = quantize_rows(rows)
    k = rows.shape[1]
    xd = (xq.reshape(-1, k // QK, QK).double() * dx.double()[..., None]).reshape(-1, k)
    out = xd @ weight.dequantize(torch.float64).T
    if bias is not None:
        out = out + bias.double()
    return out.float().view(*x.shape[:-1], -1)


class QuantLinearKernel:
    """`x @ W.T (+ bias)` against a quantized weight packed once by `pack`; x float32 or
    bfloat16 (out in x's dtype)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.quant_linear
        fn.argtypes = [_P, _I64, _I32, _P, _I32, _P, _I32, _I32, _I32, _P, _I64, _I32]
        fn.restype = _I32
        self._linear = fn
        gather = library.quant_gather_rows
        gather.argtypes = [_P, _I32, _I32, _P, _I32, _P, _I32]
        gather.restype = None
        self._gather = gather
        panel = library.quant_linear_panel
        panel.restype = _I32
        self.panel = int(panel())

    def pack(self, weight: QuantBlocks) -> torch.Tensor:
        """`weight` in the kernel's layout (csrc/quant_linear.c): uint8 [panels, K / 32,
        block bytes], the last panel's missing columns zero."""
        n, k = weight.shape
        p = self.panel
        panels = -(-n // p)
        blocks = k // QK
        u = torch.zeros(panels * p, blocks, QK, dtype=torch.uint8)
        u[:n] = weight.u.view(n, blocks, QK)
        d = torch.zeros(panels * p, blocks, dtype=torch.float16)
        m = torch.zeros_like(d)
        d[:n], m[:n] = weight.d, weight.m
        u = u.view(panels, p, blocks, QK).permute(0, 2, 1, 3)  # [panels, blocks, P, 32]
        data_bytes = p * QK * weight.bits // 8
        out = torch.empty(panels, blocks, 4 * p + data_bytes, dtype=torch.uint8)
        for i, t in enumerate((d, m)):
            scales = out[..., 2 * p * i : 2 * p * (i + 1)].view(torch.float16)
            scales.copy_(t.view(panels, p, blocks).permute(0, 2, 1))
        data = out[..., 4 * p :]
        if weight.bits == 4:
            lo = u[..., :16].reshape(panels, blocks, p, 4, 4)
            hi = u[..., 16:].reshape(panels, blocks, p, 4, 4)
            packed = data.view(panels, blocks, 4, p, 4)  # [.., h, P, 4]
            torch.bitwise_left_shift(hi, 4, out=packed.permute(0, 1, 3, 2, 4))
            packed.permute(0, 1, 3, 2, 4).bitwise_or_(lo)
        else:
            data.view(panels, blocks, 8, p, 4).copy_(
                u.reshape(panels, blocks, p, 8, 4).permute(0, 1, 3, 2, 4)
            )
        return out

    def __call__(
        self,
        x: torch.Tensor,  # [..., K], float32 or bfloat16
        packed: torch.Tensor,  # from `pack`
        bits: int,
        out_features: int,  # N
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:
        assert x.dtype in (torch.float32, torch.bfloat16)
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        if not has_contiguous_rows(rows):
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.float().contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        status = self._linear(
            rows.data_ptr(),
            rows.stride(0),
            int(x.dtype == torch.bfloat16),
            packed.data_ptr(),
            bits,
            None if bias is None else bias.data_ptr(),
            rows.shape[0],
            out_features,
            k,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status == 3:
            raise MemoryError(f"quantized linear: no memory for {rows.shape[0]} x {k} rows")
        if status:
            raise ValueError(f"quantized linear: K = {k} is not a multiple of {QK}")
        return out.view(*x.shape[:-1], out_features)

    def gather_rows(
        self, packed: torch.Tensor, bits: int, k: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows `ids` of the packed weight (K columns), dequantized to float32 [len(ids), K]
        (an embedding table kept as the LM head's panels)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        self._gather(
            packed.data_ptr(),
            bits,
            k,
            flat.data_ptr(),
            flat.numel(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out.view(*ids.shape, k)


@functools.cache
def quant_linear_kernel() -> QuantLinearKernel | None:
    """The compiled quantized linear kernel, or None (logged once, with why) where it cannot
    be built."""
    return load("quant_linear.c", QuantLinearKernel, "CPU quantized linear")
