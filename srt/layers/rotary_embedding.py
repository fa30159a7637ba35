"""Rotary position embedding with a precomputed float32 cos/sin cache.

Supported `rope_scaling` types (HF config names): default, `linear`, `dynamic` (NTK),
`llama3` and `longrope` (Phi-3's). Frequencies are computed the way HF computes them, in float32, so logits match.

`dynamic` is causal here: a position below `max_position` uses the plain frequencies and a
position p at or beyond it uses the NTK base for a sequence of length p + 1. That is what HF
produces when it generates token by token with a KV cache; HF's full re-forward of a long
sequence instead rescales every position with the final length, which a KV cache cannot do.
`longrope` is causal in the same way (short factors below the original context, long ones
from there on).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from srt.layers import fused_kernels


class RotaryEmbedding(nn.Module, fused_kernels.CpuOpsUser):
    """Applies RoPE to q and k from a cache row per position: [cos(rot/2) | sin(rot/2)]."""

    def __init__(
        self, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor, is_neox_style: bool
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        # A plain attribute, not a buffer: model.to(bf16) must not round the cache.
        self.cos_sin_cache = cos_sin_cache.to(torch.float32)
        # The last lookup, keyed by the positions tensor object itself (see _cos_sin).
        self._cached_key: tuple[torch.Tensor, int, torch.dtype] | None = None
        self._cached_cos_sin: tuple[torch.Tensor, torch.Tensor] = (cos_sin_cache, cos_sin_cache)

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        super()._apply(fn, recurse)
        device = fn(torch.empty(0, device=self.cos_sin_cache.device)).device
        self.cos_sin_cache = self.cos_sin_cache.to(device)  # follow the device, keep float32
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H*D] or [T, H, D]; k likewise -> rotated (q, k), same shapes.

        On CUDA with a fused-op provider (sgl-kernel or FlashInfer, see `fused_kernels`), q
        and k are rotated in place by its kernel (float32 math over the same cos/sin cache)
        and returned. On CPU the compiled op given by `fused_kernels.enable_cpu_ops` does the
        same for 2-D q and k (float32 math, one rounding per value in bfloat16).
        """
        if fused_kernels.use_fused(q):
            ops = fused_kernels.fused_ops()
        elif q.dim() == k.dim() == 2 and q.stride(1) == k.stride(1) == 1:
            ops = fused_kernels.cpu_ops_for(self, q, k)
        else:
            ops = None
        if ops is not None:
            ops.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, self.head_dim, self.cos_sin_cache, self.is_neox_style
            )
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        qk = _adjacent(q, k)
        if qk is not None:  # q and k of one projection: rotate them as one tensor of heads
            return self._rotate(qk, cos, sin).split([q.shape[-1], k.shape[-1]], dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot/2] for `positions`; for a neox-style rotation of the whole
        head, [cos | cos] and [-sin | sin] [T, 1, D] instead (see `_rotate`).

        Every layer of one forward shares this module and the same positions tensor, so the
        lookup runs once per forward, not per layer. The key is the tensor object plus its
        version counter, so a buffer updated in place (e.g. for CUDA-graph replay) misses.
        Inference-mode tensors (e.g. positions copied to a GPU inside the worker's
        inference_mode) have no version counter: those are looked up every time.
        """
        if positions.is_inference():
            return self._lookup(positions, dtype)
        key = (positions, positions._version, dtype)
        cached = self._cached_key
        if cached is not None and cached[0] is positions and cached[1:] == key[1:]:
            return self._cached_cos_sin
        self._cached_key = key
        self._cached_cos_sin = self._lookup(positions, dtype)
        return self._cached_cos_sin

    @property
    def _whole_head_neox(self) -> bool:
        return self.is_neox_style and self.rotary_dim == self.head_dim

    def _lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        if self._whole_head_neox:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        if self._whole_head_neox:
            # x * [cos | cos] + [x2 | x1] * [-sin | sin]: the same products and sums, bit for
            # bit, as (x1 cos - x2 sin, x2 cos + x1 sin), in four ops instead of seven.
            half = self.head_dim // 2
            out = x * cos
            out += torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
            return out.view(shape)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J style: rotate interleaved pairs
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rest.shape[-1]:
            rotated = torch.cat((rotated, rest), dim=-1)
        return rotated.reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, neox={self.is_neox_style}"
        )


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """One [T, q + k] view over q and k when k follows q in each row of one buffer (the q and k
    columns of a fused qkv projection), else None."""
    if q.dim() != 2 or k.shape[0] != q.shape[0] or q.stride() != k.stride() or q.stride(1) != 1:
        return None
    if k.dtype != q.dtype or k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size():
        return None
    if q.shape[1] + k.shape[1] > q.stride(0) and q.shape[0] > 1:
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())


def _base_inv_freq(base: float, rotary_dim: int, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (base ** (exponents / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_context_len / high_freq_factor) & (
        wavelen <= old_context_len / low_freq_factor
    )
    return torch.where(in_band, blended, scaled)


def _dynamic_ntk_inv_freq(
    base: float,
    rotary_dim: int,
    max_position: int,
    factor: float,
    length: int,
    device: torch.device,
) -> torch.Tensor:
    """[length, rotary_dim/2]: row p holds the frequencies used at position p."""
    inv_freq = _base_inv_freq(base, rotary_dim, device).expand(length, -1).clone()
    if length > max_position:
        seq_len = torch.arange(max_position + 1, length + 1, dtype=torch.float64, device=device)
        ratio = factor * seq_len / max_position - (factor - 1)
        ntk_base = (base * ratio ** (rotary_dim / (rotary_dim - 2))).float()[:, None]
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq[max_position:] = 1.0 / (ntk_base ** (exponents / rotary_dim))
    return inv_freq


def _cache_device() -> torch.device:
    device = torch.get_default_device()
    return torch.device("cpu") if device.type == "meta" else device


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Build a RotaryEmbedding; `rope_scaling` is the HF dict (`rope_type` or `type` key)."""
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    device = _cache_device()
    length = max_position
    if rope_type == "default":
        inv_freq = _base_inv_freq(base, rotary_dim, device)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(base, rotary_dim, device) / rope_scaling["factor"]
        length = int(max_position * rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(base, rotary_dim, device), rope_scaling)
    elif rope_type == "dynamic":
        length = int(max_position * rope_scaling["factor"])
        inv_freq = _dynamic_ntk_inv_freq(
            base, rotary_dim, max_position, rope_scaling["factor"], length, device
        )
    elif rope_type == "longrope":
        inv_freq = _longrope_inv_freq(base, rotary_dim, max_position, rope_scaling, device)
    else:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, "
            "dynamic, llama3, longrope"
        )
    positions = torch.arange(length, dtype=torch.int64, device=device).float()[:, None]
    freqs = positions * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if rope_type == "longrope":
        cache = cache * _longrope_attention_factor(max_position, rope_scaling)
    return RotaryEmbedding(head_dim, rotary_dim, cache, is_neox_style)


def _longrope_original(max_position: int, scaling: dict[str, Any]) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_position)


def _longrope_inv_freq(
    base: float, rotary_dim: int, max_position: int, scaling: dict[str, Any], device: Any
) -> torch.Tensor:
    """Phi-3's LongRoPE (`su`): frequencies divided per dimension by `short_factor` below
    `original_max_position_embeddings` and by `long_factor` from there on, [max_position,
    rotary_dim / 2]. Causal, like `dynamic`: what HF's model computes token by token with a
    KV cache. HF's `generate` differs once a sequence outgrows the original context: it then
    recomputes every position with the long factors (and a prompt longer than it is long
    throughout); here the positions already cached keep the short ones, as in vLLM."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    powers = base**exponent
    short = 1.0 / (
        torch.tensor(scaling["short_factor"], dtype=torch.float32, device=device) * powers
    )
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32, device=device) * powers)
    positions = torch.arange(max_position, device=device)
    past = (positions >= _longrope_original(max_position, scaling))[:, None]
    return torch.where(past, long[None, :], short[None, :])


def _longrope_attention_factor(max_position: int, scaling: dict[str, Any]) -> float:
    """HF's scale of cos and sin: `attention_factor`, else sqrt(1 + ln(factor) / ln(original))
    for the context extension factor max_position / original (1 when not extended)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = _longrope_original(max_position, scaling)
    factor = float(scaling.get("factor") or max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_settings_from_config(config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """(base, rope_scaling or None, partial_rotary_factor) from an HF config.

    transformers 5 keeps everything in `config.rope_parameters` (with `rope_theta` inside);
    older configs use `rope_theta` plus an optional `rope_scaling` dict.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        base = float(params["rope_theta"])
        scaling: dict[str, Any] | None = params
    else:
        base = float(getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None)
    partial = getattr(config, "partial_rotary_factor", None)
    if scaling is not None:
        partial = scaling.get("partial_rotary_factor", partial)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return base, scaling, float(partial if partial is not None else 1.0)
