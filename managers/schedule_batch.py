"""`ScheduleBatch`: the requests of one forward, and the KV bookkeeping to run it.

The scheduler owns one running `ScheduleBatch` (decode) and builds a new one per prefill.
`prepare_for_extend` / `prepare_for_decode` allocate KV slots (evicting from the tree when
the free list runs short) and write them into `req_to_token`; `model_worker_batch()` then
takes a snapshot of plain tensors, which is all the model worker sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from constrained.base_grammar_backend import VocabMask
from managers.req import Req
from srt.model_executor.forward_batch import ForwardMode
from srt.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarBackend
    from mem_cache.allocator import TokenToKVPoolAllocator
    from mem_cache.base_prefix_cache import BasePrefixCache
    from mem_cache.memory_pool import ReqToTokenPool


@dataclass(slots=True)
class ModelWorkerBatch:
    """Everything one forward + sample needs; no `Req` objects cross to the worker."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None
    extend_seq_lens_cpu: list[int] | None
    logits_indices: torch.Tensor  # token rows whose logits are computed
    sample_indices: torch.Tensor  # per request: its row in those logits
    sampling_info: SamplingBatchInfo
    return_logprob: bool
    top_logprobs_nums: list[int]
    # Prompt logprobs, per request: (first logits row, target token ids); None if not asked.
    input_logprob_specs: list[tuple[int, list[int]] | None] = field(default_factory=list)


@dataclass(slots=True)
class BatchLaunch:
    """A launched batch as result processing sees it (see `ScheduleBatch.launch_record`)."""

    forward_mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    chunked: list[bool]  # the request ran a non-final chunk: no token to append
    retract_counts: list[int]  # a request retracted since launch has its token dropped
    placeholders: list[int] | None  # overlap loop: the future token id of each request
    continuous: bool = False  # overlap loop: launched right after another batch


class OutOfKVError(RuntimeError):
    pass


class ScheduleBatch:
    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache,
        vocab_size: int,
        eos_token_ids: list[int],
        page_size: int = 1,
        grammar_backend: BaseGrammarBackend | None = None,
    ) -> None:
        self.reqs = reqs
        self.grammar_backend = grammar_backend
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.page_size = page_size
        self.forward_mode = ForwardMode.IDLE
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.input_ids: list[int] = []
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- allocation ----------------------------------------------------------------
    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def _last_locs(self, lens: list[int]) -> list[int]:
        """Slot of position len-1 of each request (-1 when len == 0)."""
        table = self.req_to_token_pool.req_to_token
        return [
            int(table[r.req_pool_idx, n - 1]) if n > 0 else -1
            for r, n in zip(self.reqs, lens, strict=True)
        ]

    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        table = self.req_to_token_pool.req_to_token
        new_rows = [r for r in self.reqs if r.req_pool_idx is None]
        rows = self.req_to_token_pool.alloc(len(new_rows)) if new_rows else []
        if rows is None:
            raise OutOfKVError("no free req_to_token rows")
        for req, row in zip(new_rows, rows, strict=True):
            req.req_pool_idx = row
            n = len(req.prefix_indices)
            if n:
                table[row, :n] = req.prefix_indices.to(table.dtype)
            req.cache_protected_len = n
        self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        self.seq_lens = [len(r.fill_ids) for r in self.reqs]
        self.extend_lens = [s - p for s, p in zip(self.seq_lens, self.prefix_lens, strict=True)]
        self._evict_for(sum(self.extend_lens) + len(self.reqs) * (self.page_size - 1))
        loc = self.allocator.alloc_extend(
            self.prefix_lens, self.seq_lens, self._last_locs(self.prefix_lens)
        )
        if loc is None:
            raise OutOfKVError(f"cannot allocate {sum(self.extend_lens)} KV slots for prefill")
        self.out_cache_loc = loc
        offset = 0
        self.input_ids = []
        for req, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens, strict=True):
            table[req.req_pool_idx, p:s] = loc[offset : offset + s - p].to(table.dtype)
            offset += s - p
            req.kv_allocated_len = s
            self.input_ids.extend(req.fill_ids[p:s])
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = p

    def prepare_for_decode(self) -> None:
        self.forward_mode = ForwardMode.DECODE
        self.prefix_lens = [r.kv_allocated_len for r in self.reqs]
        self.seq_lens = [n + 1 for n in self.prefix_lens]
        self.extend_lens = [1] * len(self.reqs)
        self.input_ids = [r.next_input_token() for r in self.reqs]
        self._evict_for(self.decode_tokens_needed())
        loc = self.allocator.alloc_decode(self.seq_lens, self._last_locs(self.prefix_lens))
        if loc is None:
            raise OutOfKVError("cannot allocate KV slots for decode")
        self.out_cache_loc = loc
        table = self.req_to_token_pool.req_to_token
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        cols = torch.tensor(self.prefix_lens, dtype=torch.int64)
        table[rows, cols] = loc.to(table.dtype)
        for req, s in zip(self.reqs, self.seq_lens, strict=True):
            req.kv_allocated_len = s

    def decode_tokens_needed(self) -> int:
        """Slots the next decode step allocates (whole pages when page_size > 1)."""
        if self.page_size == 1:
            return len(self.reqs)
        return self.page_size * sum(
            1 for r in self.reqs if r.kv_allocated_len % self.page_size == 0
        )

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the running decodes to this prefill as extends of length one (MIXED)."""
        running.prepare_for_decode()
        for req in running.reqs:
            req.fill_ids = req.all_ids()
            req.extend_input_len = 1
        self.reqs = self.reqs + running.reqs
        self.input_ids += running.input_ids
        self.prefix_lens += running.prefix_lens
        self.seq_lens += running.seq_lens
        self.extend_lens += running.extend_lens
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.forward_mode = ForwardMode.MIXED

    # ---- batch membership ----------------------------------------------------------
    def filter_batch(self, keep: list[Req] | None = None) -> None:
        """Keep `keep` (default: the unfinished, not chunked requests)."""
        if keep is None:
            keep = [r for r in self.reqs if not r.finished() and not r.is_chunked]
        self.reqs = keep

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs

    def launch_record(self, placeholders: list[int] | None = None) -> BatchLaunch:
        """What result processing needs, frozen at launch: the overlap loop builds (and
        mutates) the next batch before this one's result is processed."""
        for req, ph in zip(self.reqs, placeholders or [], strict=False):
            if not req.is_chunked:
                req.pending_token = ph
        return BatchLaunch(
            forward_mode=self.forward_mode,
            reqs=list(self.reqs),
            prefix_lens=list(self.prefix_lens),
            chunked=[r.is_chunked for r in self.reqs],
            retract_counts=[r.retract_count for r in self.reqs],
            placeholders=placeholders,
        )

    # ---- snapshot for the worker ---------------------------------------------------
    def model_worker_batch(self) -> ModelWorkerBatch:
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        specs: list[tuple[int, list[int]] | None] = []
        token_offset = 0
        for req, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens, strict=True):
            first = s - 1
            spec = None
            if self.forward_mode.is_extend() and not req.input_logprobs_done:
                prompt_len = len(req.origin_input_ids)
                lo = max(p, req.logprob_start_len - 1)
                hi = min(s, prompt_len - 1)
                first = min(lo, s - 1)
                targets = req.origin_input_ids[lo + 1 : hi + 1] if hi > lo else []
                spec = (len(logits_rows) + (lo - first), targets)
            specs.append(spec)
            base = token_offset - p
            logits_rows.extend(range(base + first, base + s))
            sample_rows.append(len(logits_rows) - 1)
            token_offset += s - p
        extend = self.forward_mode.is_extend()
        vocab_mask = None
        if self.grammar_backend is not None and any(r.grammar for r in self.reqs):
            vocab_mask = VocabMask(self.grammar_backend, [r.grammar for r in self.reqs])
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(self.input_ids, dtype=torch.int64),
            positions=_positions(self.prefix_lens, self.seq_lens),
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int64),
            seq_lens_cpu=list(self.seq_lens),
            extend_prefix_lens_cpu=list(self.prefix_lens) if extend else None,
            extend_seq_lens_cpu=list(self.extend_lens) if extend else None,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            sample_indices=torch.tensor(sample_rows, dtype=torch.int64),
            sampling_info=SamplingBatchInfo.from_reqs(
                self.reqs,
                self.vocab_size,
                "cpu",
                eos_token_ids=self.eos_token_ids,
                # Index of the token each row samples, from KV lengths: right even when the
                # overlap loop has not appended the previous token to `output_ids` yet.
                output_lens=[
                    max(s - len(r.origin_input_ids), 0)
                    for r, s in zip(self.reqs, self.seq_lens, strict=True)
                ],
                vocab_mask=vocab_mask,
            ),
            return_logprob=any(r.return_logprob for r in self.reqs),
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in self.reqs],
            input_logprob_specs=specs,
        )


def _positions(prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    if all(s - p == 1 for p, s in zip(prefix_lens, seq_lens, strict=True)):
        return torch.tensor(prefix_lens, dtype=torch.int64)
    return torch.cat(
        [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens, strict=True)]
    )
