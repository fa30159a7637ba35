"""Decode attention of the torch_native backend: length buckets over staged K/V.

Decode on a CPU is bound by memory traffic, and gathering every running request's K/V out
of the paged pool each step doubles it. So the K/V a decode batch has gathered is kept
("staged") per layer, and while the next decode batch is the same requests, one token
longer each, a step only appends the new token's K/V to the staged copy. Anything else
(another batch, an extend in between, a request outgrowing the staged capacity) plans
afresh and re-gathers. The pool stays the source of truth: the staged copy is only ever a
gather of it plus tokens that were written to both.

Staged K/V are head-major (`[b, Hkv, cap, D]`, contiguous), K in float32 and V in the pool
dtype, so attention is two batched matmuls per bucket with float32 scores and softmax, over
the whole capacity with padding masked out by an additive bias: on a CPU that is faster
than SDPA's kernel at one query per head, which reads K/V far below the memory bandwidth.
Requests are sorted by length into a few buckets so padding
wastes little; there is no per-request loop. Padding reads KV slot 0 (finite values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch

# Buckets hold at least this many requests; at most this many buckets.
DECODE_BUCKET_MIN_REQS = 16
DECODE_MAX_BUCKETS = 4
# Staged capacity beyond the longest request, so appends need no re-gather for a while.
STAGING_HEADROOM = 64
# Above this many bytes of staged K/V the backend gathers every step instead.
STAGING_MAX_BYTES = 2 << 30


@dataclass(slots=True)
class DecodeBucket:
    rows: torch.Tensor | None  # int64 [b]: rows of the batch (None: the whole batch in order)
    pool_rows: torch.Tensor  # int64 [b]: rows of req_to_token
    lens: torch.Tensor  # int64 [b]: tokens with KV, the new one included
    cap: int  # staged positions per request
    window: int | None = None  # the windowed layers' window (they use `window_bias`)
    bias: torch.Tensor | None = None  # float32 [b, 1, 1, cap]: 0 where a token is, else -inf
    window_bias: torch.Tensor | None = None  # the same, -inf also before the window
    new_pos: torch.Tensor | None = None  # int64 [b]: position of the new token
    # Per layer: K float32 and V [b, Hkv, cap, D], absent until the layer first gathers.
    staged_k: dict[int, torch.Tensor] = field(default_factory=dict)
    staged_v: dict[int, torch.Tensor] = field(default_factory=dict)

    def advance(self, lens: torch.Tensor) -> None:
        self.lens = lens
        positions = torch.arange(self.cap, device=lens.device)
        bias = torch.zeros(len(lens), 1, 1, self.cap, device=lens.device)
        self.bias = bias.masked_fill_(
            (positions[None, :] >= lens[:, None])[:, None, None, :], float("-inf")
        )
        if self.window is not None:
            before = (positions[None, :] < lens[:, None] - self.window)[:, None, None, :]
            self.window_bias = self.bias.masked_fill(before, float("-inf"))
        self.new_pos = lens - 1


@dataclass(slots=True)
class DecodePlan:
    buckets: list[DecodeBucket]
    pool_rows: tuple[int, ...]
    lens: tuple[int, ...]
    staged: bool  # False: gather per step into throwaway buffers

    def continues(self, pool_rows: tuple[int, ...], lens: tuple[int, ...]) -> bool:
        """Is (pool_rows, lens) this batch one decode step later, within capacity?"""
        return (
            self.staged
            and pool_rows == self.pool_rows
            and all(n == m + 1 for n, m in zip(lens, self.lens, strict=True))
            and all(int(b.lens.max()) < b.cap for b in self.buckets)
        )


def plan_decode(
    forward_batch: ForwardBatch,
    previous: DecodePlan | None,
    bytes_per_token: int,
    window: int | None = None,
) -> DecodePlan:
    """The plan step: continue the previous decode plan if this batch extends it. `window`:
    the model's windowed layers' (each bucket masks for both kinds of layer)."""
    pool_rows = tuple(forward_batch.req_pool_indices.tolist())
    lens = tuple(forward_batch.seq_lens_cpu)
    seq_lens = forward_batch.seq_lens
    # Rows sharing a request's KV (a speculative verify step: one row per draft position)
    # hold drafts that may be rejected and overwritten: nothing of theirs is kept.
    shares_rows = len(set(pool_rows)) < len(pool_rows)
    if previous is not None and not shares_rows and previous.continues(pool_rows, lens):
        for bucket in previous.buckets:
            bucket.advance(seq_lens if bucket.rows is None else seq_lens[bucket.rows])
        return DecodePlan(previous.buckets, pool_rows, lens, staged=True)
    batch = len(lens)
    num_buckets = max(1, min(DECODE_MAX_BUCKETS, batch // DECODE_BUCKET_MIN_REQS))
    if num_buckets == 1:
        groups: list[list[int] | None] = [None]
    else:
        order = sorted(range(batch), key=lens.__getitem__)
        groups = [
            order[i * batch // num_buckets : (i + 1) * batch // num_buckets]
            for i in range(num_buckets)
        ]
    buckets = []
    for members in groups:
        rows = None if members is None else torch.tensor(members, device=seq_lens.device)
        bucket_lens = seq_lens if rows is None else seq_lens[rows]
        bucket_pool_rows = (
            forward_batch.req_pool_indices if rows is None else forward_batch.req_pool_indices[rows]
        )
        buckets.append(
            DecodeBucket(rows, bucket_pool_rows, bucket_lens, int(bucket_lens.max()), window)
        )
    headroom = sum(len(b.pool_rows) * (b.cap + STAGING_HEADROOM) for b in buckets)
    staged = not shares_rows and headroom * bytes_per_token <= STAGING_MAX_BYTES
    for bucket in buckets:
        if staged:
            bucket.cap += STAGING_HEADROOM
        bucket.advance(bucket.lens)
    return DecodePlan(buckets, pool_rows, lens, staged)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping of attention scores, cap * tanh(score / cap), in place."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def decode_attention(
    q: torch.Tensor,  # [B, H * D]
    k_new: torch.Tensor,  # [B, Hkv * D], already written to the pool
    v_new: torch.Tensor,
    k_cache: torch.Tensor,  # pool [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    layer: RadixAttention,
    plan: DecodePlan,
) -> torch.Tensor:
    batch = q.shape[0]
    kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
    group = layer.num_heads // kv_heads
    # Query heads h = kv * group + g share KV head kv: view the group as "query positions"
    # of that KV head, so K/V are never repeated.
    q_grouped = q.reshape(batch, kv_heads, group, head_dim).to(k_cache.dtype)
    k_new = k_new.reshape(batch, -1).to(k_cache.dtype)
    v_new = v_new.reshape(batch, -1).to(k_cache.dtype)
    if len(plan.buckets) == 1:
        (bucket,) = plan.buckets
        out = _bucket_attention(
            q_grouped, k_new, v_new, k_cache, v_cache, req_to_token, layer, bucket, plan.staged
        )
    else:
        out = torch.empty_like(q_grouped)
        for bucket in plan.buckets:
            rows = bucket.rows
            o = _bucket_attention(
                q_grouped.index_select(0, rows),
                k_new.index_select(0, rows),
                v_new.index_select(0, rows),
                k_cache,
                v_cache,
                req_to_token,
                layer,
                bucket,
                plan.staged,
            )
            out.index_copy_(0, rows, o)
    return out.reshape(batch, layer.num_heads * head_dim)


def _bucket_attention(
    q: torch.Tensor,  # [b, Hkv, group, D]
    k_new: torch.Tensor,  # [b, Hkv * D]
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    layer: RadixAttention,
    bucket: DecodeBucket,
    staged: bool,
) -> torch.Tensor:
    b, kv_heads, group, head_dim = q.shape
    cap, layer_id = bucket.cap, layer.layer_id
    if staged and layer_id in bucket.staged_k:
        k_rows, v_rows = bucket.staged_k[layer_id], bucket.staged_v[layer_id]
        batch_idx = torch.arange(b, device=q.device)
        k_rows[batch_idx, :, bucket.new_pos] = k_new.view(b, kv_heads, head_dim).to(k_rows.dtype)
        v_rows[batch_idx, :, bucket.new_pos] = v_new.view(b, kv_heads, head_dim)
    else:
        slots = _padded_slots(req_to_token, bucket.pool_rows, bucket.lens, cap)
        k_rows = _gather_head_major(k_cache, slots, b, cap).float()
        v_rows = _gather_head_major(v_cache, slots, b, cap)
        if staged:
            bucket.staged_k[layer_id], bucket.staged_v[layer_id] = k_rows, v_rows
    rows = q.reshape(b * kv_heads, group, head_dim).float()
    scores = torch.bmm(rows, k_rows.view(b * kv_heads, cap, head_dim).transpose(1, 2))
    bias = bucket.window_bias if layer.sliding_window is not None else bucket.bias
    assert bias is not None, "a windowed layer needs a backend built with its window"
    scores = soft_cap(scores.mul_(layer.scaling), layer.logit_cap)
    scores = scores.view(b, kv_heads, group, cap).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(v_rows.dtype).view(b * kv_heads, group, cap)
    out = torch.bmm(probs, v_rows.view(b * kv_heads, cap, head_dim))
    return out.view(b, kv_heads, group, head_dim)


def _gather_head_major(cache: torch.Tensor, slots: torch.Tensor, b: int, cap: int) -> torch.Tensor:
    """cache [num_slots, Hkv, D], slots [b * cap] -> contiguous [b, Hkv, cap, D]."""
    rows = cache.view(cache.shape[0], -1).index_select(0, slots)
    return rows.view(b, cap, *cache.shape[1:]).transpose(1, 2).contiguous()


def _padded_slots(
    req_to_token: torch.Tensor, pool_rows: torch.Tensor, lens: torch.Tensor, cap: int
) -> torch.Tensor:
    """KV slots of positions [0, cap) per request, flattened; positions past len -> slot 0."""
    width = min(cap, req_to_token.shape[1])
    table = req_to_token[pool_rows, :width].to(torch.int64)
    valid = torch.arange(width, device=table.device)[None, :] < lens[:, None]
    slots = torch.where(valid, table, torch.zeros_like(table))
    if width < cap:
        slots = F.pad(slots, (0, cap - width))
    return slots.reshape(-1)
