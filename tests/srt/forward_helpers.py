"""Hand-built pools and ForwardBatches for model and attention tests.

`ForwardBatchBuilder` plays the scheduler: it owns mem_cache's ReqToTokenPool and MHATokenToKVPool, gives
each request a row, hands out KV pages in a shuffled order (so gathers are really
scattered), and builds EXTEND / MIXED / DECODE batches, running the backend's plan step.
With `page_size > 1` a request's token at position i sits at offset i % page_size of its
(i // page_size)-th page, as the paged allocator lays it out.
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
        page_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        self.kv_pool = MHATokenToKVPool(
            num_slots,
            page_size=page_size,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
            device=device,
        )
        self.backend = backend or TorchNativeAttnBackend()
        gen = torch.Generator().manual_seed(seed)
        # page 0 is the pool's dummy; real pages are 1..num_slots // page_size
        self._free_pages = (torch.randperm(num_slots // page_size, generator=gen) + 1).tolist()
        self._pages: dict[int, list[int]] = {}  # request id -> its pages in order
        self.rows: dict[int, int] = {}  # request id -> req_to_token row
        self.seq_lens: dict[int, int] = {}

    def _alloc(self, rid: int, start: int, n: int) -> list[int]:
        """Slots of positions start .. start + n of request `rid`, taking pages as needed."""
        pages = self._pages.setdefault(rid, [])
        slots = []
        for pos in range(start, start + n):
            if pos // self.page_size == len(pages):
                assert self._free_pages, "test KV pool is full"
                pages.append(self._free_pages.pop(0))
            slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        return slots

    def share_prefix(self, src: int, dst: int) -> int:
        """New request `dst` starts with `src`'s tokens on the very same KV slots, as a radix
        cache hit leaves them (whole pages only); returns the tokens shared."""
        assert dst not in self.rows
        shared = self.seq_lens[src] // self.page_size * self.page_size
        row = self.rows.setdefault(dst, len(self.rows))
        self._pages[dst] = list(self._pages[src][: shared // self.page_size])
        r2t = self.req_to_token_pool.req_to_token
        r2t[row, :shared] = r2t[self.rows[src], :shared]
        self.seq_lens[dst] = shared
        return shared

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
            slots = self._alloc(rid, prefix, len(ids))
            self.req_to_token_pool.req_to_token[row, prefix : prefix + len(ids)] = torch.tensor(
                slots, dtype=torch.int32, device=self.device
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
            return torch.tensor(values, dtype=torch.int64, device=self.device)

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
