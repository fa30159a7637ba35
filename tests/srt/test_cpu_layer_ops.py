"""The compiled CPU layer ops (srt/kernels/csrc/layer_ops.c) against the layers' torch code, and
how the modules of a model get them (`fused_kernels.enable_cpu_ops`)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from srt.kernels import layer_ops
from srt.layers import fused_kernels
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm, rms_norm_native
from srt.layers.rotary_embedding import get_rope

OPS = layer_ops.layer_ops_kernel()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C compiler: the layer ops cannot build")

DTYPES = [torch.float32, torch.bfloat16]
# Rows: a decode batch (one thread) and a prefill (the OpenMP path, > 32768 elements).
ROWS = [3, 300]


def one_ulp(dtype: torch.dtype) -> float:
    """The relative size of one unit in the last place."""
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a scalar tail after the vector lanes
def test_rmsnorm_and_fused_add_match_torch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (0.5 + torch.rand(hidden, generator=gen)).to(dtype)

    out = OPS.rmsnorm(x, weight, 1e-5)
    ref = rms_norm_native(x, weight, 1e-5)
    torch.testing.assert_close(out, ref, rtol=4 * one_ulp(dtype), atol=1e-6)

    summed = x + residual
    normed, res = x.clone(), residual.clone()
    OPS.fused_add_rmsnorm(normed, res, weight, 1e-5)
    assert torch.equal(res, summed)  # the add rounds exactly as a tensor add does
    torch.testing.assert_close(
        normed, rms_norm_native(summed, weight, 1e-5), rtol=4 * one_ulp(dtype), atol=1e-6
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 20])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    x = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^-|g| underflows; signed zero
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    out = OPS.silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=4 * one_ulp(dtype), atol=1e-6)
    # More leading dims and a strided view (the gate/up halves of a wider buffer).
    wide = torch.randn(2, rows, 2 * inter + 8, generator=gen).to(dtype)[..., : 2 * inter]
    torch.testing.assert_close(
        OPS.silu_and_mul(wide),
        F.silu(wide[..., :inter]) * wide[..., inter:],
        rtol=4 * one_ulp(dtype),
        atol=1e-6,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "neox"),
    [(64, 64, True), (128, 128, True), (32, 32, True), (64, 32, True), (16, 16, False)],
)
def test_rope_in_place_matches_torch(dtype, rows, head_dim, rotary_dim, neox):
    """Whole-head and partial rotations, both pairings, on q and k as the column views of one
    fused qkv buffer (v must stay untouched)."""
    rope = get_rope(head_dim, rotary_dim, 4096, 10000.0, None, is_neox_style=neox)
    q_heads, k_heads = 6, 2
    gen = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(dtype)
    split = (q_heads * head_dim, (q_heads + k_heads) * head_dim)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    ref_q, ref_k = rope(positions, qkv[:, : split[0]].clone(), qkv[:, split[0] : split[1]].clone())

    out = qkv.clone()
    OPS.apply_rope_with_cos_sin_cache_inplace(
        positions,
        out[:, : split[0]],
        out[:, split[0] : split[1]],
        head_dim,
        rope.cos_sin_cache,
        neox,
    )
    # float32: one fused multiply-add against torch's two roundings; bfloat16: one rounding
    # of the float32 result against torch's bfloat16 cos/sin and a rounding per op.
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(out[:, : split[0]], ref_q, **tol)
    torch.testing.assert_close(out[:, split[0] : split[1]], ref_k, **tol)
    assert torch.equal(out[:, split[1] :], qkv[:, split[1] :])


def test_rope_position_outside_the_cache_raises_and_writes_nothing():
    rope = get_rope(64, 64, 128, 10000.0, None)
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    before = (q.clone(), k.clone())
    with pytest.raises(IndexError, match="outside the cache"):
        OPS.apply_rope_with_cos_sin_cache_inplace(
            torch.tensor([0, 5, 128]), q, k, 64, rope.cos_sin_cache, True
        )
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_accepts_only_cpu_float32_and_bfloat16_of_one_dtype():
    assert OPS.accepts(torch.zeros(2, 4), torch.zeros(4))
    assert OPS.accepts(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not OPS.accepts(torch.zeros(2, 4, dtype=torch.float16))
    assert not OPS.accepts(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16))


def test_modules_use_the_ops_only_once_given_them(monkeypatch):
    """Without `enable_cpu_ops` a module runs its torch code; with it, the compiled op, and
    the results agree. A float16 input (no kernel) keeps the torch code."""
    model = torch.nn.ModuleDict(
        {"norm": RMSNorm(64), "act": SiluAndMul(), "rope": get_rope(16, 16, 64, 10000.0)}
    )
    calls: list[str] = []

    class CountingOps:  # a test double around the real ops, to see which path ran
        def __getattr__(self, name):
            attr = getattr(OPS, name)
            if name == "accepts":
                return attr
            return lambda *a, **kw: (calls.append(name), attr(*a, **kw))[1]

    monkeypatch.setattr(layer_ops, "layer_ops_kernel", lambda: CountingOps())
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    h = torch.randn(5, 128)
    torch_out = (model["norm"](x, res), model["act"](h))
    assert calls == []
    assert fused_kernels.enable_cpu_ops(model) == 3
    fused_out = (model["norm"](x.clone(), res.clone()), model["act"](h))
    assert calls == ["fused_add_rmsnorm", "silu_and_mul"]
    torch.testing.assert_close(fused_out, torch_out, rtol=1e-6, atol=1e-6)
    model["act"](h.half())
    assert calls == ["fused_add_rmsnorm", "silu_and_mul"]


def test_no_compiler_leaves_the_torch_code(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))
    layer_ops.layer_ops_kernel.cache_clear()
    try:
        norm = RMSNorm(64)
        with caplog.at_level(logging.WARNING, logger="srt.kernels.build"):
            assert fused_kernels.enable_cpu_ops(norm) == 0
        assert "no C compiler" in caplog.text
        assert norm.cpu_ops is None
        x = torch.randn(2, 64)
        torch.testing.assert_close(norm(x), rms_norm_native(x, norm.weight, 1e-6))
    finally:
        layer_ops.layer_ops_kernel.cache_clear()


@pytest.mark.parametrize("rows", [3, 40])  # 40 x 49152: the OpenMP path
@pytest.mark.parametrize("cols", [49152, 100, 7])  # 100: a tail after the lanes; 7: tail only
def test_argmax_matches_torch_with_ties_nan_and_infinities(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    # Whole numbers in a small range: many ties, across lanes and in the tail.
    x = torch.randint(-20, 20, (rows, cols), generator=gen).float()
    x[0] = float("-inf")  # all -inf: index 0
    x[1, cols // 2] = float("nan")
    x[1, cols - 1] = float("nan")  # the first NaN wins
    x[2, :] = 3.0
    x[2, cols - 1] = float("inf")
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))
    wide = torch.randn(rows, cols + 5, generator=gen)[:, :cols]  # a row stride of cols + 5
    assert torch.equal(OPS.argmax(wide), wide.argmax(dim=-1))


def test_greedy_sampler_uses_the_kernel_on_cpu(monkeypatch):
    from srt.sampling import sampler

    calls = []

    class SpyOps:  # a test double of the kernel object: records, then runs the real kernel
        def argmax(self, x):
            calls.append(tuple(x.shape))
            return OPS.argmax(x)

    monkeypatch.setattr(layer_ops, "layer_ops_kernel", SpyOps)
    logits = torch.randn(4, 1000)
    assert torch.equal(sampler.greedy_ids(logits), logits.argmax(dim=-1))
    assert calls == [(4, 1000)]
    assert torch.equal(sampler.greedy_ids(logits.double()), logits.double().argmax(dim=-1))
    assert calls == [(4, 1000)]  # float64: torch's argmax
