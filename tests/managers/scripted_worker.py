"""`ScriptedWorker`: a test double for the model worker, with no model.

It keeps, per KV slot, the token and position written there. Each forward it reads every
request's sequence back through `req_to_token` (as attention would) and returns a token that
is a hash of that whole sequence. A wrong slot, a missing prefix or a stale row therefore
changes the output, which makes it a strict checker of the scheduler's KV bookkeeping, and
its outputs do not depend on batching, chunking, caching or retraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from managers.io_struct import BatchTokenIDOut
from managers.schedule_batch import GenerationBatchResult, ModelWorkerBatch
from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.memory_pool import ReqToTokenPool


@dataclass
class ScriptedModelConfig:
    vocab_size: int = 1000
    eos_token_ids: list[int] = field(default_factory=lambda: [0])
    context_len: int = 4096
    model_path: str | None = None


def sequence_token(tokens: list[int], vocab_size: int, avoid: set[int]) -> int:
    """The scripted next token of a sequence (never one of `avoid`, e.g. EOS)."""
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ t) * 1099511628211) % (1 << 61)
    token = h % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


class ScriptedWorker:
    def __init__(
        self,
        max_total_tokens: int = 4096,
        max_running_requests: int = 64,
        page_size: int = 1,
        model_config: ScriptedModelConfig | None = None,
    ) -> None:
        self.model_config = model_config or ScriptedModelConfig()
        self.req_to_token_pool = ReqToTokenPool(
            max_running_requests, self.model_config.context_len + 4
        )
        self.allocator = TokenToKVPoolAllocator(max_total_tokens, page_size)
        n_slots = max_total_tokens + 2 * page_size
        self.slot_token = torch.full((n_slots,), -1, dtype=torch.int64)
        self.slot_pos = torch.full((n_slots,), -1, dtype=torch.int64)
        self.forward_calls: list[ModelWorkerBatch] = []

    def get_memory_pool(self) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator]:
        return self.req_to_token_pool, self.allocator

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        self.forward_calls.append(mwb)
        self.slot_token[mwb.out_cache_loc] = torch.tensor(mwb.input_ids, dtype=torch.int64)
        self.slot_pos[mwb.out_cache_loc] = mwb.positions()
        table = self.req_to_token_pool.req_to_token
        cfg = self.model_config
        next_ids = []
        for row, seq_len in zip(mwb.req_pool_indices, mwb.seq_lens, strict=True):
            slots = table[row, :seq_len].long()
            assert bool((slots > 0).all()), f"row {row} reads the dummy slot"
            positions = self.slot_pos[slots]
            assert torch.equal(positions, torch.arange(seq_len)), f"row {row}: KV out of order"
            tokens = self.slot_token[slots].tolist()
            next_ids.append(sequence_token(tokens, cfg.vocab_size, set(cfg.eos_token_ids)))
        return GenerationBatchResult(next_token_ids=next_ids)


def scripted_output(prompt: list[int], n: int, cfg: ScriptedModelConfig | None = None) -> list[int]:
    """What the scripted worker generates for `prompt`, computed directly."""
    cfg = cfg or ScriptedModelConfig()
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = sequence_token(seq, cfg.vocab_size, set(cfg.eos_token_ids))
        out.append(t)
        seq.append(t)
    return out


def assert_idle_and_clean(driver: Any) -> None:
    """The scheduler of `driver` (an `InProcessDriver`) is idle and holds no KV: every slot
    free or evictable, the integrity check passes."""
    sched = driver.scheduler
    assert sched.is_idle()
    sched.check_memory()
    assert sched.kv.tree.protected_size() == 0
    assert sched.kv.token_usage() == 0


def first_token_order(driver: Any) -> list[str]:
    """Record the order in which requests produce their first token."""
    order: list[str] = []
    sink = driver.scheduler.emitter.sink

    def record(batch: BatchTokenIDOut) -> None:
        for out in batch.outputs:
            if out.new_token_ids and out.rid not in order:
                order.append(out.rid)
        sink(batch)

    driver.scheduler.emitter.sink = record
    return order
