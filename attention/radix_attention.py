"""The attention layer models use; the math lives in the batch's attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from srt.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Attention over the paged KV pool for one layer.

    Holds only the layer's shape and identity; `forward_batch.attn_backend` writes the new
    tokens' K/V into the pool at `out_cache_loc` and computes attention over the cached
    prefix plus the new tokens.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
    ) -> None:
        """`sliding_window`: the positions a query sees, itself included (position p sees
        p - sliding_window + 1 .. p); None: every earlier position. `logit_cap`: scores
        become cap * tanh(score / cap) before the softmax (Gemma 2); None: as they are."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        backend = forward_batch.attn_backend
        assert backend is not None, "forward_batch.attn_backend is not set"
        if torch._C._autograd._profiler_enabled():
            # A named range for profiles (bench_offline --profile). Entered only under a
            # profiler: it costs time in every layer even when no profiler runs.
            with torch.profiler.record_function("attention"):
                return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scaling={self.scaling:.4g}, "
            f"sliding_window={self.sliding_window}, logit_cap={self.logit_cap}"
        )


def attention_layers(model: nn.Module) -> list[RadixAttention]:
    """The model's attention layers, in module order (backends that plan per layer kind,
    e.g. a window or a soft cap, read them at construction)."""
    return [m for m in model.modules() if isinstance(m, RadixAttention)]
