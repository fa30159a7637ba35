"""The layers' fused path, plumbed through a pure-torch fake of the providers' documented ops.

On CPU the real kernels never run (`use_fused` is False for CPU tensors); these tests force
the fused path with fake ops that follow sgl-kernel's / FlashInfer's documented semantics
(in-place where the real ones are), and check the layers give the torch path's results.
How the provider is chosen is tested in test_fused_provider.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from srt.layers import fused_kernels
from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm, rms_norm_native
from srt.layers.rotary_embedding import get_rope


def _fake_sgl_kernel() -> types.SimpleNamespace:
    calls: list[str] = []

    def rmsnorm(x, weight, eps=1e-6):
        calls.append("rmsnorm")
        assert x.dim() == 2 and x.is_contiguous()
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    def fused_add_rmsnorm(x, residual, weight, eps=1e-6):
        calls.append("fused_add_rmsnorm")
        assert x.dim() == 2 and residual.shape == x.shape
        residual.add_(x)
        x.copy_(rmsnorm(residual, weight, eps))

    def silu_and_mul(x):
        calls.append("silu_and_mul")
        assert (x.shape[-1] * x.element_size()) % 16 == 0
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]

    def apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_size, cache, is_neox=True):
        calls.append("rope")
        assert cache.dtype == torch.float32 and positions.dtype == torch.int64
        rot = cache.shape[1]
        cos, sin = cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for t in (q, k):
            x = t.view(t.shape[0], -1, head_size)
            part = x[..., :rot].float()
            if is_neox:
                x1, x2 = part.chunk(2, dim=-1)
                out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            else:
                x1, x2 = part[..., 0::2], part[..., 1::2]
                out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
            x[..., :rot] = out.to(t.dtype)

    return types.SimpleNamespace(
        calls=calls,
        rmsnorm=rmsnorm,
        fused_add_rmsnorm=fused_add_rmsnorm,
        silu_and_mul=silu_and_mul,
        apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace,
    )


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    fake = _fake_sgl_kernel()
    monkeypatch.setattr(fused_kernels, "use_fused", lambda x: True)
    monkeypatch.setattr(fused_kernels, "fused_ops", lambda: fake)
    return fake


def test_rmsnorm_fused_path(fused) -> None:
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.data = torch.randn(32)
    x, res = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    torch.testing.assert_close(norm(x), rms_norm_native(x, norm.weight, 1e-5))
    out, summed = norm(x.clone(), res.clone())
    torch.testing.assert_close(summed, x + res)
    torch.testing.assert_close(out, rms_norm_native(x + res, norm.weight, 1e-5))
    assert fused.calls == ["rmsnorm", "fused_add_rmsnorm", "rmsnorm"]


def test_silu_and_mul_fused_path_and_alignment_fallback(fused) -> None:
    x = torch.randn(4, 16)
    ref = torch.nn.functional.silu(x[:, :8]) * x[:, 8:]
    torch.testing.assert_close(SiluAndMul()(x), ref)
    assert fused.calls == ["silu_and_mul"]
    odd = torch.randn(4, 6)  # 3 float32 per half: rows of 24 bytes, not a multiple of 16
    torch.testing.assert_close(SiluAndMul()(odd), torch.nn.functional.silu(odd[:, :3]) * odd[:, 3:])
    assert fused.calls == ["silu_and_mul"]


@pytest.mark.parametrize(("rotary_dim", "neox"), [(16, True), (8, True), (16, False)])
def test_rope_fused_path_in_place(fused, monkeypatch, rotary_dim: int, neox: bool) -> None:
    rope = get_rope(16, rotary_dim, 64, 10000.0, None, is_neox_style=neox)
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    q, k = qkv[:, : 4 * 16], qkv[:, 4 * 16 : 6 * 16]  # views, as the models pass them
    positions = torch.tensor([0, 3, 9, 10, 63])
    with monkeypatch.context() as m:
        m.setattr(fused_kernels, "use_fused", lambda x: False)
        ref_q, ref_k = rope(positions, q.clone(), k.clone())
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    torch.testing.assert_close(qkv[:, 4 * 16 : 6 * 16], ref_k)
    assert fused.calls == ["rope"]


def test_cpu_tensors_never_take_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU tensor, of any dtype, never even triggers the provider choice."""

    def refuse(*_: object) -> None:
        raise AssertionError("a CPU tensor must not choose a provider")

    monkeypatch.setattr(fused_kernels, "select_provider", refuse)
    monkeypatch.setattr(fused_kernels, "_provider", None)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert not fused_kernels.use_fused(torch.randn(2, 2).to(dtype))


def test_rope_lookup_of_inference_tensors() -> None:
    """Positions made inside inference_mode (as on a GPU worker) have no version counter."""
    rope = get_rope(16, 16, 64, 10000.0, None)
    q, k = torch.randn(3, 32), torch.randn(3, 32)
    expected = rope(torch.tensor([1, 2, 3]), q, k)
    with torch.inference_mode():
        got = rope(torch.tensor([1, 2, 3]), q, k)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
