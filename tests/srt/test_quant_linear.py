"""The quantized linear kernel (`srt/kernels/csrc/quant_linear.c`) against the same arithmetic
in torch (`reference_linear`: the dequantized weight times the dequantized int8 rows), for
every weight type, odd shapes, float32 and bfloat16 inputs, on this CPU's build and, on an
AVX-512 machine, on the AVX2 build too; GGUF blocks read exactly as `gguf` dequantizes them;
on-load quantization within its rounding bound."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from srt.kernels.quant import (
    QK,
    QuantBlocks,
    from_gguf,
    quant_linear_kernel,
    quantize,
    quantize_rows,
    reference_linear,
)

pytestmark = pytest.mark.skipif(quant_linear_kernel() is None, reason="no C compiler / x86")

SHAPES = [(1, 32), (37, 64), (100, 96), (70, 1536)]  # (N, K): N off the panel width
ROWS = [1, 2, 3, 9, 13, 70]  # the register blocks and their tails


def gguf_blocks(kind: str, weight: torch.Tensor) -> QuantBlocks:
    """`weight` quantized by gguf's own quantizer (llama.cpp's reference), read back."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(weight.numpy(), qtype)
    return from_gguf(kind, torch.from_numpy(raw.reshape(-1).copy()), *weight.shape)


def weight_of(kind: str, n: int, k: int, seed: int = 0) -> QuantBlocks:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    return quantize(w, kind) if kind.startswith("int") else gguf_blocks(kind, w)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "int4", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_reference_arithmetic(kind: str, shape: tuple[int, int]) -> None:
    kernel = quant_linear_kernel()
    n, k = shape
    weight = weight_of(kind, n, k)
    packed = kernel.pack(weight)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen) * 3
        for b in (None, bias):
            out = kernel(x, packed, weight.bits, n, b)
            ref = reference_linear(x, weight, b)
            # Integer sums are exact; what differs is the order of float additions.
            scale = (x.abs() @ weight.dequantize().abs().T).max().item()
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * scale + 1e-6)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_bfloat16_inputs_round_the_float32_result(kind: str) -> None:
    kernel = quant_linear_kernel()
    weight = weight_of(kind, 70, 96)
    packed = kernel.pack(weight)
    x = (torch.randn(5, 96) * 2).bfloat16()
    out = kernel(x, packed, weight.bits, 70)
    assert out.dtype == torch.bfloat16
    ref = reference_linear(x, weight)  # float32 from the same bf16 inputs
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-4)


def test_a_zero_row_and_strided_rows() -> None:
    kernel = quant_linear_kernel()
    weight = weight_of("Q4_1", 37, 64)
    packed = kernel.pack(weight)
    x = torch.randn(4, 128)[:, :64]  # rows 128 apart
    x[1] = 0
    out = kernel(x, packed, 4, 37)
    torch.testing.assert_close(out, reference_linear(x.contiguous(), weight), rtol=0, atol=1e-4)
    assert torch.equal(out[1], torch.zeros(37))


def test_k_off_the_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "int8")
    kernel = quant_linear_kernel()
    packed = kernel.pack(weight_of("int8", 4, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel(torch.randn(2, 40), packed, 8, 4)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_as_gguf_does(kind: str) -> None:
    import gguf

    w = torch.randn(33, 128) * 0.2
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w.numpy(), qtype)
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    ours = from_gguf(kind, torch.from_numpy(raw.reshape(-1).copy()), 33, 128)
    assert torch.equal(ours.dequantize(), theirs)
    assert int(ours.u.max()) < 2**ours.bits


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_on_load_quantization_is_within_half_a_step(kind: str) -> None:
    w = torch.randn(16, 256) * torch.logspace(-3, 1, 16)[:, None]  # rows of every scale
    blocks = quantize(w, kind)
    error = (blocks.dequantize() - w).abs().view(16, -1, QK)
    step = blocks.d.float()[..., None]
    # Half a step from rounding u, plus what rounding d and m to float16 moves the grid (m
    # by 2^-11 of |min|, u d by 2^-11 of the range).
    bound = step * 0.5 + w.abs().view(16, -1, QK).amax(-1, keepdim=True) * 2**-9
    assert (error <= bound).all()


def test_gather_rows_are_the_dequantized_rows() -> None:
    kernel = quant_linear_kernel()
    for kind in ("Q4_1", "Q8_0"):
        weight = weight_of(kind, 70, 96)
        packed = kernel.pack(weight)
        ids = torch.tensor([[0, 69], [33, 1]])
        rows = kernel.gather_rows(packed, weight.bits, weight.shape[1], ids)
        assert torch.equal(rows, weight.dequantize()[ids])


def test_quantize_rows_is_symmetric_int8_per_block() -> None:
    x = torch.tensor([[1.0] * 31 + [-127.0] + [0.0] * 32])
    xq, dx = quantize_rows(x)
    assert dx.tolist() == [[1.0, 0.0]]
    assert xq[0, 31] == -127 and xq[0, 0] == 1 and (xq[0, 32:] == 0).all()


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512bw" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="this CPU's own build is the AVX2 one")
def test_the_avx2_build_equals_the_reference(tmp_path) -> None:
    """`ATEN_CPU_CAPABILITY=avx2` builds the kernels for x86-64-v3 (no VNNI: the
    `vpmaddubsw` path and Q8's nibble split), which AVX2-only machines run."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", RADIXRT_CACHE_DIR=str(tmp_path))
    script = (
        "from tests.srt import test_quant_linear as t\n"
        "from srt.kernels.quant import quant_linear_kernel\n"
        "assert quant_linear_kernel().panel == 16\n"
        "for kind in ('Q4_1', 'Q8_0', 'int8'):\n"
        "    for shape in t.SHAPES:\n"
        "        t.test_kernel_equals_the_reference_arithmetic(kind, shape)\n"
        "t.test_gather_rows_are_the_dequantized_rows()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
