"""Hand-built pools and ForwardBatches for model and attention tests.

`ForwardBatchBuilder` plays the scheduler: it owns mem_cache's ReqToTokenPool and MHATokenToKVPool, gives
each request a row, hands out KV slots in a shuffled order (so gathers are really
scattered), and builds EXTEND / MIXED / DECODE batches, running the backend's plan step.
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend
from attention.torch_native_backend import TorchNativeAttnBackend
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode


class ForwardBatchBuilder:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        num_slots: int = 2048,
        max_reqs: int = 16,
        max_context_len: int = 512,
        backend: AttentionBackend | None = None,
        seed: int = 0,
    ) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len)
        self.kv_pool = MHATokenToKVPool(
            num_slots,
            page_size=1,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
        )
        self.backend = backend or TorchNativeAttnBackend()
        gen = torch.Generator().manual_seed(seed)
        # slot 0 is the pool's dummy; real slots are 1..num_slots
        self._free_slots = (torch.randperm(num_slots, generator=gen) + 1).tolist()
        self.rows: dict[int, int] = {}  # request id -> req_to_token row
        self.seq_lens: dict[int, int] = {}

    def _alloc(self, n: int) -> list[int]:
        slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        assert len(slots) == n, "test KV pool is full"
        return slots

    def build(
        self,
        new_tokens: list[tuple[int, list[int]]],
        mode: ForwardMode | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """One batch: (request id, its new token ids) per request, prefix = what it has."""
        if mode is None:
            all_one = all(len(ids) == 1 for _, ids in new_tokens)
            known = all(rid in self.rows for rid, _ in new_tokens)
            mode = ForwardMode.DECODE if all_one and known else ForwardMode.EXTEND
        input_ids: list[int] = []
        positions: list[int] = []
        out_cache_loc: list[int] = []
        rows, prefix_lens, extend_lens, seq_lens = [], [], [], []
        for rid, ids in new_tokens:
            row = self.rows.setdefault(rid, len(self.rows))
            prefix = self.seq_lens.get(rid, 0)
            slots = self._alloc(len(ids))
            self.req_to_token_pool.req_to_token[row, prefix : prefix + len(ids)] = torch.tensor(
                slots, dtype=torch.int32
            )
            self.seq_lens[rid] = prefix + len(ids)
            input_ids += ids
            positions += range(prefix, prefix + len(ids))
            out_cache_loc += slots
            rows.append(row)
            prefix_lens.append(prefix)
            extend_lens.append(len(ids))
            seq_lens.append(prefix + len(ids))

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        is_decode = mode.is_decode()
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(new_tokens),
            input_ids=i64(input_ids),
            positions=i64(positions),
            out_cache_loc=i64(out_cache_loc),
            req_pool_indices=i64(rows),
            seq_lens=i64(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens=None if is_decode else i64(prefix_lens),
            extend_seq_lens=None if is_decode else i64(extend_lens),
            extend_prefix_lens_cpu=None if is_decode else prefix_lens,
            extend_seq_lens_cpu=None if is_decode else extend_lens,
            logits_indices=logits_indices,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(batch)
        return batch
