"""The attention backend contract: plan once per batch, run once per layer.

`init_forward_metadata` (plan) runs on the host before the model forward and stores every
index tensor the run step needs in `forward_batch.attn_metadata`. `forward_extend` /
`forward_decode` (run) are called by each `RadixAttention` layer; they must not make host
decisions or synchronise with the device, so that a decode step can be captured in a graph.

CUDA-graph decode (`srt/model_executor/cuda_graph_runner.py`) needs three more hooks, which a
backend implements when it sets `supports_cuda_graph`: `init_cuda_graph_state(max_bs)`
allocates the persistent index buffers once; `init_forward_metadata_capture_cuda_graph`
plans a padded decode batch whose metadata lives in those buffers (before capture); and
`init_forward_metadata_replay_cuda_graph` re-plans the same batch size with new values in
the same buffers (before each replay).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Base class of every attention backend (torch_native, flashinfer, ...)."""

    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan step: compute per-batch metadata into `forward_batch.attn_metadata`."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Run step for EXTEND / MIXED batches. q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Run step for DECODE batches (one new token per request) -> [B, H*D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch on the forward mode: DECODE -> decode; EXTEND and MIXED -> extend."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if mode.is_extend():
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        raise ValueError(f"attention cannot run a batch in forward mode {mode.name}")

    @staticmethod
    def save_kv(
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write the new tokens' K/V ([T, Hkv*D]) into the pool at `out_cache_loc`."""
        pool = forward_batch.token_to_kv_pool
        assert pool is not None, "forward_batch.token_to_kv_pool is required to save KV"
        cache_k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
        cache_v = v.reshape(-1, layer.num_kv_heads, layer.head_dim)
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, cache_k, cache_v)
