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
K/V are never repeated. Decode sorts requests by length into a few buckets and runs two
batched matmuls per bucket over a padded `[b, max_len]` gather, staged across the steps of
one batch (`torch_native_decode.py`), padding pointing at slot 0 and masked out (slot 0 must
hold finite values); there is no per-request loop. The `cpu` backend (`cpu_backend.py`)
replaces both with compiled kernels where they can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attention.base import AttentionBackend
from attention.torch_native_decode import DecodePlan, decode_attention, plan_decode, soft_cap

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch


@dataclass(slots=True)
class QueryBlock:
    """Queries [q0, q1) of one request see keys [key_start, num_keys), with `bias` masking
    the rest (key_start > 0 only under a sliding window)."""

    q0: int
    q1: int
    num_keys: int
    bias: torch.Tensor | None  # float32 [q1 - q0, num_keys - key_start]; None: no mask needed
    key_start: int = 0


@dataclass(slots=True)
class ExtendRequestPlan:
    q_start: int  # first of this request's new tokens in the batch
    q_end: int
    kv_indices: torch.Tensor  # int64 [seq_len]: KV slot of every token, prefix + new
    blocks: list[QueryBlock]
    window_blocks: list[QueryBlock] | None = None  # the same, for the windowed layers


# Extend attention materialises [heads, block, keys] scores per query block, and each block
# only reads the keys up to its last query: 128 rows gave a faster prefill than 512
# (`python -m bench.bench_one_batch --attention-backend torch_native --input-len 512`).
EXTEND_QUERY_BLOCK = 128


@dataclass(slots=True)
class ExtendMetadata:
    requests: list[ExtendRequestPlan]


def gather_slots(
    buffer: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """buffer [num_slots, Hkv, D], slots [N] -> [N, Hkv, D] (into `out` [N, Hkv*D] if given).

    Gathers rows of the 2-D view: on CPU, index_select over a 3-D float32 tensor is several
    times slower than over the same memory viewed as [num_slots, Hkv * D].
    """
    flat = buffer.view(buffer.shape[0], -1)
    rows = (
        flat.index_select(0, slots) if out is None else torch.index_select(flat, 0, slots, out=out)
    )
    return rows.view(slots.shape[0], *buffer.shape[1:])


class TorchNativeAttnBackend(AttentionBackend):
    """Pure PyTorch attention over the paged KV pool."""

    def __init__(self, sliding_window: int | None = None, **_unused: Any) -> None:
        # Every backend is built with the same keyword set by the model runner; this one
        # derives the rest from each ForwardBatch. `sliding_window`: the model's windowed
        # layers' window, planned for beside the full causal masks. The last decode plan is
        # kept so the next decode step of the same batch can reuse its staged K/V.
        self.sliding_window = sliding_window
        self._decode_plan: DecodePlan | None = None

    # ---- plan -------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            pool = forward_batch.token_to_kv_pool
            assert pool is not None, "forward_batch.token_to_kv_pool is required"
            k_cache = pool.get_key_buffer(0)
            # Staged K is float32, staged V in the pool dtype.
            bytes_per_token = len(pool.k_buffer) * k_cache[0].numel() * (4 + k_cache.element_size())
            self._decode_plan = plan_decode(
                forward_batch, self._decode_plan, bytes_per_token, self.sliding_window
            )
            forward_batch.attn_metadata = self._decode_plan
            return
        # Any other forward may reuse rows or change lengths: stop reusing staged K/V.
        self._decode_plan = None
        if mode.is_extend():
            forward_batch.attn_metadata = self._plan_extend(forward_batch)
        else:
            forward_batch.attn_metadata = None

    @staticmethod
    def _req_to_token(forward_batch: ForwardBatch) -> torch.Tensor:
        pool = forward_batch.req_to_token_pool
        assert pool is not None, "forward_batch.req_to_token_pool is required"
        return pool.req_to_token

    @staticmethod
    def _extend_lens(forward_batch: ForwardBatch) -> tuple[list[int], list[int]]:
        """(prefix_lens, extend_lens) of an extend batch, per request, as Python ints."""
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        extend_lens = forward_batch.extend_seq_lens_cpu
        if prefix_lens is None:
            assert forward_batch.extend_prefix_lens is not None
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
        if extend_lens is None:
            assert forward_batch.extend_seq_lens is not None
            extend_lens = forward_batch.extend_seq_lens.tolist()
        return list(prefix_lens), list(extend_lens)

    def _plan_extend(self, forward_batch: ForwardBatch) -> ExtendMetadata:
        req_to_token = self._req_to_token(forward_batch)
        prefix_lens, extend_lens = self._extend_lens(forward_batch)
        pool_rows = forward_batch.req_pool_indices.tolist()
        device = req_to_token.device

        requests: list[ExtendRequestPlan] = []
        q_start = 0
        for row, prefix_len, extend_len in zip(pool_rows, prefix_lens, extend_lens):
            seq_len = prefix_len + extend_len
            kv_indices = req_to_token[row, :seq_len].to(torch.int64)
            starts = range(0, extend_len, EXTEND_QUERY_BLOCK)
            ends = [min(q0 + EXTEND_QUERY_BLOCK, extend_len) for q0 in starts]
            plan = ExtendRequestPlan(
                q_start,
                q_start + extend_len,
                kv_indices,
                [_query_block(prefix_len, q0, q1, device) for q0, q1 in zip(starts, ends)],
            )
            if self.sliding_window is not None:
                plan.window_blocks = [
                    _query_block(prefix_len, q0, q1, device, self.sliding_window)
                    for q0, q1 in zip(starts, ends)
                ]
            requests.append(plan)
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
            blocks = req.window_blocks if layer.sliding_window is not None else req.blocks
            assert blocks is not None, "a windowed layer needs a backend built with its window"
            for blk in blocks:
                lo, hi = req.q_start + blk.q0, req.q_start + blk.q1
                out[:, :, lo:hi] = _grouped_attention(
                    q_grouped[:, :, lo:hi],
                    k_req[:, blk.key_start : blk.num_keys],
                    v_req[:, blk.key_start : blk.num_keys],
                    blk.bias,
                    layer.scaling,
                    layer.logit_cap,
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
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = decode_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            self._req_to_token(forward_batch),
            layer,
            forward_batch.attn_metadata,
        )
        return out.to(q.dtype)


def _query_block(
    prefix_len: int, q0: int, q1: int, device: torch.device, window: int | None = None
) -> QueryBlock:
    """Query j (position p = prefix_len + j) sees keys 0..p (bottom-right causal), or under
    a window keys p - window + 1..p; the block reads from the first key its first query
    sees."""
    num_keys = prefix_len + q1
    key_start = 0 if window is None else max(0, prefix_len + q0 - window + 1)
    if q1 - q0 == 1:
        # A lone query sees exactly the keys it reads.
        return QueryBlock(q0, q1, num_keys, None, key_start)
    query_pos = torch.arange(prefix_len + q0, prefix_len + q1, device=device)
    key_pos = torch.arange(key_start, num_keys, device=device)
    hidden = key_pos[None, :] > query_pos[:, None]
    if window is not None:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    bias = torch.zeros(q1 - q0, num_keys - key_start, device=device)
    return QueryBlock(q0, q1, num_keys, bias.masked_fill_(hidden, float("-inf")), key_start)


def _grouped_attention(
    q: torch.Tensor,  # [Hkv, group, n, D]
    k: torch.Tensor,  # [Hkv, S, D]
    v: torch.Tensor,  # [Hkv, S, D]
    bias: torch.Tensor | None,  # float32 [n, S]
    scale: float,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Attention of a GQA query group against its shared KV head, as two batched matmuls.

    The query heads of one KV head are stacked as extra rows, so K/V are never repeated.
    Scores and softmax are float32; probabilities meet V in its dtype.
    """
    kv_heads, group, n, head_dim = q.shape
    # Scores in float32 (a bf16 bmm would round them to bf16 before the softmax).
    rows = q.reshape(kv_heads, group * n, head_dim).float()
    scores = soft_cap(torch.bmm(rows, k.float().transpose(1, 2)).mul_(scale), logit_cap)
    if bias is not None:
        scores = scores.view(kv_heads, group, n, -1).add_(bias).view(kv_heads, group * n, -1)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v).view(kv_heads, group, n, head_dim)
