"""Reference attention backend: gather KV through `req_to_token`, then SDPA.

Runs on CPU and GPU and is what every other backend is tested against.

- Plan (`init_forward_metadata`, once per batch): turn `req_to_token` rows into KV-slot
  index tensors (and masks) in `forward_batch.attn_metadata`.
- Run (`forward_extend` / `forward_decode`, once per layer): write the new K/V into the
  pool, gather each request's K/V with `index_select`, attend, return the output in the
  query dtype.

Extend loops over requests and, within one, over query blocks of at most
EXTEND_QUERY_BLOCK rows (bottom-right aligned causal masks planned once per batch); it
attends with two batched matmuls per block, stacking a KV head's query group as rows so
K/V are never repeated. Decode sorts requests by length into a few buckets and runs one
SDPA per bucket over a padded `[b, max_len]` gather, padding pointing at slot 0 and masked
out (slot 0 must hold finite values); there is no per-request loop.
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
class QueryBlock:
    """Queries [q0, q1) of one request see keys [0, num_keys), with `bias` masking the rest."""

    q0: int
    q1: int
    num_keys: int
    bias: torch.Tensor | None  # float32 [q1 - q0, num_keys], 0 or -inf; None: no mask needed


@dataclass(slots=True)
class ExtendRequestPlan:
    q_start: int  # first of this request's new tokens in the batch
    q_end: int
    kv_indices: torch.Tensor  # int64 [seq_len]: KV slot of every token, prefix + new
    blocks: list[QueryBlock]


# Extend attention materialises [heads, block, keys] scores; this bounds the block.
EXTEND_QUERY_BLOCK = 512


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
            blocks = [
                _query_block(prefix_len, q0, min(q0 + EXTEND_QUERY_BLOCK, extend_len), device)
                for q0 in range(0, extend_len, EXTEND_QUERY_BLOCK)
            ]
            requests.append(ExtendRequestPlan(q_start, q_start + extend_len, kv_indices, blocks))
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
        kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        # [T, H, D] with H = kv * group + g  ->  [Hkv, group, T, D]
        q_grouped = (
            q.reshape(num_tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3).to(k_cache.dtype)
        )
        out = q_grouped.new_empty(kv_heads, group, num_tokens, head_dim)
        for req in meta.requests:
            k_req = gather_slots(k_cache, req.kv_indices).transpose(0, 1)  # [Hkv, S, D]
            v_req = gather_slots(v_cache, req.kv_indices).transpose(0, 1)
            for blk in req.blocks:
                lo, hi = req.q_start + blk.q0, req.q_start + blk.q1
                out[:, :, lo:hi] = _grouped_attention(
                    q_grouped[:, :, lo:hi],
                    k_req[:, : blk.num_keys],
                    v_req[:, : blk.num_keys],
                    blk.bias,
                    layer.scaling,
                )
        return out.permute(2, 0, 1, 3).reshape(num_tokens, -1).to(q.dtype)

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


def _query_block(prefix_len: int, q0: int, q1: int, device: torch.device) -> QueryBlock:
    """Query j (position prefix_len + j) sees keys 0..prefix_len + j: bottom-right causal."""
    num_keys = prefix_len + q1
    if q1 - q0 == 1:
        return QueryBlock(q0, q1, num_keys, None)  # the last query of the block sees all keys
    query_pos = torch.arange(prefix_len + q0, prefix_len + q1, device=device)
    key_pos = torch.arange(num_keys, device=device)
    bias = torch.zeros(q1 - q0, num_keys, device=device)
    bias.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    return QueryBlock(q0, q1, num_keys, bias)


def _grouped_attention(
    q: torch.Tensor,  # [Hkv, group, n, D]
    k: torch.Tensor,  # [Hkv, S, D]
    v: torch.Tensor,  # [Hkv, S, D]
    bias: torch.Tensor | None,  # float32 [n, S]
    scale: float,
) -> torch.Tensor:
    """Attention of a GQA query group against its shared KV head, as two batched matmuls.

    The query heads of one KV head are stacked as extra rows, so K/V are never repeated. On
    CPU this beats SDPA's kernel ~4x for prefill in bf16; softmax runs in float32.
    """
    kv_heads, group, n, head_dim = q.shape
    rows = q.reshape(kv_heads, group * n, head_dim)
    scores = torch.bmm(rows, k.transpose(1, 2)).float().mul_(scale)
    if bias is not None:
        scores = scores.view(kv_heads, group, n, -1).add_(bias).view(kv_heads, group * n, -1)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v).view(kv_heads, group, n, head_dim)
