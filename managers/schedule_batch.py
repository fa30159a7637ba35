"""The records of one forward: `ScheduleBatch` (the requests and their token ranges, built
after `KVManager` allocated their slots), `ModelWorkerBatch` (its snapshot in plain tensors,
all the model worker sees), `GenerationBatchResult` (what the worker returns) and
`BatchLaunch` (what result processing needs, frozen at launch).
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


@dataclass
class GenerationBatchResult:
    """What the worker returns for one forward: one entry per request of the batch."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Prompt logprobs per request (None where not asked): values for that forward's targets.
    input_token_logprobs: list[list[float] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None


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


@dataclass
class ScheduleBatch:
    """The requests of one forward: per request the KV positions [prefix_len, seq_len) it
    computes, and the slots (`out_cache_loc`) `KVManager` allocated for them."""

    forward_mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    seq_lens: list[int]
    input_ids: list[int]
    out_cache_loc: torch.Tensor

    @classmethod
    def extend(cls, reqs: list[Req], out_cache_loc: torch.Tensor) -> ScheduleBatch:
        """A prefill of each request's `fill_ids` after its matched prefix."""
        prefix_lens = [r.kv.prefix_len() for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        input_ids: list[int] = []
        for req, p, s in zip(reqs, prefix_lens, seq_lens, strict=True):
            input_ids.extend(req.fill_ids[p:s])
        return cls(ForwardMode.EXTEND, reqs, prefix_lens, seq_lens, input_ids, out_cache_loc)

    @classmethod
    def decode(cls, reqs: list[Req], out_cache_loc: torch.Tensor) -> ScheduleBatch:
        """One token per request, at the position its KV span just grew by."""
        seq_lens = [r.kv.allocated_len for r in reqs]
        return cls(
            ForwardMode.DECODE,
            reqs,
            [n - 1 for n in seq_lens],
            seq_lens,
            [r.next_input_token() for r in reqs],
            out_cache_loc,
        )

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for p, s in zip(self.prefix_lens, self.seq_lens, strict=True)]

    def is_empty(self) -> bool:
        return not self.reqs

    def mix(self, decodes: ScheduleBatch) -> None:
        """Append running decodes to this prefill as extends of length one (MIXED)."""
        for req in decodes.reqs:
            req.fill_ids = req.all_ids()
        self.reqs = self.reqs + decodes.reqs
        self.input_ids += decodes.input_ids
        self.prefix_lens += decodes.prefix_lens
        self.seq_lens += decodes.seq_lens
        self.out_cache_loc = torch.cat([self.out_cache_loc, decodes.out_cache_loc])
        self.forward_mode = ForwardMode.MIXED

    def unfinished(self) -> list[Req]:
        """The requests that go on decoding: not finished, not in the middle of a prompt."""
        return [r for r in self.reqs if not r.finished() and not r.is_chunked]

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
    def model_worker_batch(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        grammar_backend: BaseGrammarBackend | None = None,
    ) -> ModelWorkerBatch:
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        specs: list[tuple[int, list[int]] | None] = []
        token_offset = 0
        for req, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens, strict=True):
            first = s - 1
            spec = None
            if self.forward_mode.is_extend() and req.needs_input_logprobs():
                assert req.logprobs is not None
                prompt_len = len(req.origin_input_ids)
                lo = max(p, req.logprobs.start_len - 1)
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
        if grammar_backend is not None and any(r.grammar for r in self.reqs):
            vocab_mask = VocabMask(grammar_backend, [r.grammar for r in self.reqs])
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(self.input_ids, dtype=torch.int64),
            positions=_positions(self.prefix_lens, self.seq_lens),
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=torch.tensor([r.kv.row for r in self.reqs], dtype=torch.int64),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int64),
            seq_lens_cpu=list(self.seq_lens),
            extend_prefix_lens_cpu=list(self.prefix_lens) if extend else None,
            extend_seq_lens_cpu=self.extend_lens if extend else None,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            sample_indices=torch.tensor(sample_rows, dtype=torch.int64),
            sampling_info=SamplingBatchInfo.from_reqs(
                self.reqs,
                vocab_size,
                "cpu",
                eos_token_ids=eos_token_ids,
                # Index of the token each row samples, from KV lengths: right even when the
                # overlap loop has not appended the previous token to `output_ids` yet.
                output_lens=[
                    max(s - len(r.origin_input_ids), 0)
                    for r, s in zip(self.reqs, self.seq_lens, strict=True)
                ],
                vocab_mask=vocab_mask,
            ),
            return_logprob=any(r.logprobs is not None for r in self.reqs),
            top_logprobs_nums=[r.logprobs.top_n if r.logprobs else 0 for r in self.reqs],
            input_logprob_specs=specs,
        )


def _positions(prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    if all(s - p == 1 for p, s in zip(prefix_lens, seq_lens, strict=True)):
        return torch.tensor(prefix_lens, dtype=torch.int64)
    return torch.cat(
        [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens, strict=True)]
    )
