"""RoPE's CPU fast path: q and k of one qkv projection rotate as one tensor, and the
whole-head neox rotation is the textbook formula bit for bit."""

from __future__ import annotations

import pytest
import torch

from srt.layers.rotary_embedding import _adjacent, get_rope


def textbook(x: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    heads = x.reshape(x.shape[0], -1, cos.shape[-1] * 2)
    x1, x2 = heads.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_qk_rotation_is_bitwise_the_textbook_formula(dtype: torch.dtype) -> None:
    rope = get_rope(64, 64, 4096, 10000.0)
    torch.manual_seed(0)
    positions = torch.tensor([0, 5, 77, 4095, 1])
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    assert _adjacent(q, k) is not None and _adjacent(k, q) is None
    q_rot, k_rot = rope(positions, q, k)
    assert torch.equal(q_rot, textbook(q, rope.cos_sin_cache, positions))
    assert torch.equal(k_rot, textbook(k, rope.cos_sin_cache, positions))
    # Separate tensors take the per-tensor path and give the same bits.
    q2, k2 = rope(positions, q.clone(), k.clone())
    assert _adjacent(q.clone(), k.clone()) is None
    assert torch.equal(q2, q_rot) and torch.equal(k2, k_rot)


def test_partial_rotary_keeps_the_tail() -> None:
    rope = get_rope(64, 32, 128, 10000.0)
    x = torch.randn(3, 2 * 64)
    q_rot, _ = rope(torch.tensor([1, 2, 3]), x, x.clone())
    heads, rotated = x.view(3, 2, 64), q_rot.view(3, 2, 64)
    assert torch.equal(rotated[..., 32:], heads[..., 32:])
    assert not torch.equal(rotated[..., :32], heads[..., :32])
