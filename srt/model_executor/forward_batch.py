"""What one model forward needs, as tensors.

`ScheduleBatch` (managers/) owns requests and CPU bookkeeping; it builds a `ForwardBatch`,
which is everything the model, the attention backend and the logits processor read. The
attention backend's plan step (`init_forward_metadata`) attaches its own metadata to
`attn_metadata` once per batch; every layer then reads it without host decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attention.registry import AttentionBackend
    from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = 2  # one new token per request
    MIXED = 3  # extends and decodes together; decodes are extends of length 1
    IDLE = 4  # nothing to run
    # Running requests' last tokens and their drafts (speculative decoding): the scheduler's
    # name for a step the model runs as a DECODE of one row per new token
    # (`ScheduleBatch._verify_worker_batch`).
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        """True when some request has more than one new token (EXTEND or MIXED)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass(slots=True)
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    # One entry per new token (T = sum of extend lens, or batch_size for decode).
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each new token's K/V is written to
    # One entry per request.
    req_pool_indices: torch.Tensor  # int64 [B]: row of req_to_token
    seq_lens: torch.Tensor  # int64 [B]: tokens with KV after this forward (prefix + new)
    seq_lens_cpu: list[int]
    # Extend / mixed only (decode: None). prefix = tokens already in KV before this forward.
    extend_prefix_lens: torch.Tensor | None = None  # int64 [B]
    extend_seq_lens: torch.Tensor | None = None  # int64 [B]: new tokens per request
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Logits are computed only at these token indices (into the T new tokens); the model
    # returns logits of shape [len(logits_indices), vocab].
    logits_indices: torch.Tensor | None = None  # int64 [N]
    # The logits feed only an argmax per row (greedy sampling, no logprobs, nothing applied
    # to them first): the LM head may return logits exact only where a row's maximum can be
    # (`LMHead.argmax_logits`).
    argmax_only: bool = False
    # A decode batch staged straight into the static inputs of the CUDA graph of this padded
    # size (`step_inputs.GraphInputs`): its replay copies nothing. None: staged elsewhere.
    graph_bs: int | None = None
    # Pools and backend for this forward.
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    # Set by the attention backend's plan step.
    attn_metadata: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
