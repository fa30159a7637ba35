"""Reference attention backend: gather KV through `req_to_token`, then SDPA.

Runs on CPU and GPU and is what every other backend is tested against.

- Plan (`init_forward_metadata`, once per batch): turn `req_to_token` rows into KV-slot
  index tensors (and masks) in `forward_batch.attn_metadata`.
- Run (`forward_extend` / `forward_decode`, once per layer): write the new K/V into the
  pool, gather the request's K/V with `index_select`, run SDPA in the pool dtype (SDPA keeps
  the softmax in float32), return the output in the query dtype.

Extend loops over requests (each has its own prefix and extend length; the mask is
bottom-right aligned causal). Decode sorts requests by length into a few buckets and runs
one SDPA per bucket over a padded `[b, max_len]` gather, padding pointing at slot 0 and
masked out (slot 0 must hold finite values); there is no per-request loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class ExtendRequestPlan:
    q_start: int  # first of this request's new tokens in the batch
    q_end: int
    kv_indices: torch.Tensor  # int64 [seq_len]: KV slot of every token, prefix + new
    # None: no mask needed (a square causal block uses is_causal, one query sees everything)
    mask: torch.Tensor | None  # bool [extend_len, seq_len], bottom-right aligned causal
    is_causal: bool


@dataclass(slots=True)
class ExtendMetadata:
    requests: list[ExtendRequestPlan]


@dataclass(slots=True)
class DecodeBucket:
    """Requests of similar length, gathered and attended together."""

    rows: torch.Tensor | None  # int64 [b]: their rows in the batch (None: the whole batch)
    kv_indices: torch.Tensor  # int64 [b * max_len], padding -> slot 0
    mask: torch.Tensor  # bool [b, 1, 1, max_len]: True where the token exists
    max_len: int
    # Gather outputs [b * max_len, Hkv * D], allocated once per batch and reused by every
    # layer: a fresh multi-MiB allocation per layer costs more than the gather on CPU.
    k_gathered: torch.Tensor
    v_gathered: torch.Tensor


@dataclass(slots=True)
class DecodeMetadata:
    buckets: list[DecodeBucket]


# Decode requests are sorted by length and split into buckets of at least this many, so
# padding to each bucket's longest request wastes little (W1 decode: ~2x less attention time).
DECODE_BUCKET_MIN_REQS = 8
DECODE_MAX_BUCKETS = 8


def gather_slots(
    buffer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """buffer [num_slots, Hkv, D], slots [N] -> [N, Hkv, D] (into `out` [N, Hkv*D] if given).

    Gathers rows of the 2-D view: on CPU, index_select over a 3-D float32 tensor is ~8x
    slower than over the same memory viewed as [num_slots, Hkv * D].
    """
    flat = buffer.view(buffer.shape[0], -1)
    rows = (
        flat.index_select(0, slots) if out is None else torch.index_select(flat, 0, slots, out=out)
    )
    return rows.view(slots.shape[0], *buffer.shape[1:])


class TorchNativeAttnBackend(AttentionBackend):
    """Pure PyTorch attention over the paged KV pool."""

    def __init__(self, **_unused: Any) -> None:
        # Every backend is built with the same keyword set by the model runner; this one
        # derives everything it needs from each ForwardBatch.
        pass

    # ---- plan -------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            forward_batch.attn_metadata = self._plan_decode(forward_batch)
        elif mode.is_extend():
            forward_batch.attn_metadata = self._plan_extend(forward_batch)
        else:
            forward_batch.attn_metadata = None

    @staticmethod
    def _req_to_token(forward_batch: ForwardBatch) -> torch.Tensor:
        pool = forward_batch.req_to_token_pool
        assert pool is not None, "forward_batch.req_to_token_pool is required"
        return pool.req_to_token

    def _plan_decode(self, forward_batch: ForwardBatch) -> DecodeMetadata:
        req_to_token = self._req_to_token(forward_batch)
        kv_pool = forward_batch.token_to_kv_pool
        assert kv_pool is not None, "forward_batch.token_to_kv_pool is required"
        k_cache, _ = kv_pool.get_kv_buffer(0)
        seq_lens = forward_batch.seq_lens_cpu
        batch = len(seq_lens)
        num_buckets = max(1, min(DECODE_MAX_BUCKETS, batch // DECODE_BUCKET_MIN_REQS))
        if num_buckets == 1:
            bucket = self._plan_bucket(
                req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, None, k_cache
            )
            return DecodeMetadata(buckets=[bucket])
        order = sorted(range(batch), key=seq_lens.__getitem__)
        buckets = []
        for b in range(num_buckets):
            members = order[b * batch // num_buckets : (b + 1) * batch // num_buckets]
            rows = torch.tensor(members, device=req_to_token.device)
            pool_rows = forward_batch.req_pool_indices[rows]
            buckets.append(
                self._plan_bucket(req_to_token, pool_rows, forward_batch.seq_lens[rows], rows, k_cache)
            )
        return DecodeMetadata(buckets=buckets)

    @staticmethod
    def _plan_bucket(
        req_to_token: torch.Tensor,
        pool_rows: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor | None,
        k_cache: torch.Tensor,
    ) -> DecodeBucket:
        max_len = int(lens.max())
        table = req_to_token[pool_rows, :max_len].to(torch.int64)
        positions = torch.arange(max_len, device=table.device)
        valid = positions[None, :] < lens.to(table.device)[:, None]
        kv_indices = torch.where(valid, table, torch.zeros_like(table)).reshape(-1)
        gathered_shape = (kv_indices.shape[0], k_cache[0].numel())
        return DecodeBucket(
            rows=rows,
            kv_indices=kv_indices,
            mask=valid[:, None, None, :],
            max_len=max_len,
            k_gathered=k_cache.new_empty(gathered_shape),
            v_gathered=k_cache.new_empty(gathered_shape),
        )

    def _plan_extend(self, forward_batch: ForwardBatch) -> ExtendMetadata:
        req_to_token = self._req_to_token(forward_batch)
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        extend_lens = forward_batch.extend_seq_lens_cpu
        if prefix_lens is None:
            assert forward_batch.extend_prefix_lens is not None
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
        if extend_lens is None:
            assert forward_batch.extend_seq_lens is not None
            extend_lens = forward_batch.extend_seq_lens.tolist()
        pool_rows = forward_batch.req_pool_indices.tolist()
        device = req_to_token.device

        requests: list[ExtendRequestPlan] = []
        q_start = 0
        for row, prefix_len, extend_len in zip(pool_rows, prefix_lens, extend_lens):
            seq_len = prefix_len + extend_len
            kv_indices = req_to_token[row, :seq_len].to(torch.int64)
            mask: torch.Tensor | None = None
            is_causal = False
            if extend_len > 1:
                if prefix_len == 0:
                    is_causal = True  # square block: torch's top-left causal is right
                else:
                    # query j sits at position prefix_len + j and sees keys 0..prefix_len + j
                    mask = torch.ones(extend_len, seq_len, dtype=torch.bool, device=device)
                    mask = mask.tril(diagonal=prefix_len)
            requests.append(
                ExtendRequestPlan(q_start, q_start + extend_len, kv_indices, mask, is_causal)
            )
            q_start += extend_len
        return ExtendMetadata(requests=requests)

    # ---- run --------------------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        meta: ExtendMetadata = forward_batch.attn_metadata
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        num_tokens = q.shape[0]
        q_heads = q.reshape(num_tokens, layer.num_heads, layer.head_dim).to(k_cache.dtype)
        out = q.new_empty(num_tokens, layer.num_heads * layer.head_dim)
        gqa = layer.num_heads != layer.num_kv_heads
        for req in meta.requests:
            q_req = q_heads[req.q_start : req.q_end].transpose(0, 1)  # [H, ext, D]
            k_req = gather_slots(k_cache, req.kv_indices).transpose(0, 1)  # [Hkv, S, D]
            v_req = gather_slots(v_cache, req.kv_indices).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q_req,
                k_req,
                v_req,
                attn_mask=req.mask,
                is_causal=req.is_causal,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[req.q_start : req.q_end] = o.transpose(0, 1).reshape(req.q_end - req.q_start, -1)
        return out

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        meta: DecodeMetadata = forward_batch.attn_metadata
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        batch = q.shape[0]
        kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        # Query heads h = kv * group + g share KV head kv, so view the group as "query
        # positions" of that KV head: no repeat of K/V, one SDPA per bucket.
        q_grouped = q.reshape(batch, kv_heads, group, head_dim).to(k_cache.dtype)
        if len(meta.buckets) == 1:
            o = self._decode_bucket(q_grouped, k_cache, v_cache, meta.buckets[0], layer)
        else:
            o = q_grouped.new_empty(q_grouped.shape)
            for bucket in meta.buckets:
                q_b = q_grouped.index_select(0, bucket.rows)
                o.index_copy_(0, bucket.rows, self._decode_bucket(q_b, k_cache, v_cache, bucket, layer))
        return o.reshape(batch, layer.num_heads * head_dim).to(q.dtype)

    @staticmethod
    def _decode_bucket(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        bucket: DecodeBucket,
        layer: RadixAttention,
    ) -> torch.Tensor:
        shape = (q.shape[0], bucket.max_len, layer.num_kv_heads, layer.head_dim)
        k = gather_slots(k_cache, bucket.kv_indices, bucket.k_gathered).view(shape).transpose(1, 2)
        v = gather_slots(v_cache, bucket.kv_indices, bucket.v_gathered).view(shape).transpose(1, 2)
        # -> [b, Hkv, group, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=layer.scaling)
