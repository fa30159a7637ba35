"""The records of one forward: `ScheduleBatch` (the requests and their token ranges, built
after `KVManager` allocated their slots), `ModelWorkerBatch` (its snapshot in plain tensors,
all the model worker sees), `GenerationBatchResult` (what the worker returns) and
`BatchLaunch` (what result processing needs, frozen at launch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from constrained.base_grammar_backend import VocabMask
from managers.req import Req
from srt.model_executor.forward_batch import ForwardMode
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.speculative.verify import DraftVocabMask, draft_rows

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarBackend


@dataclass(slots=True)
class ModelWorkerBatch:
    """Everything one forward + sample needs, as host lists; no `Req` objects cross to the
    worker, which stages these on the device in one copy (`ModelWorker.to_forward_batch`)."""

    forward_mode: ForwardMode
    input_ids: list[int]  # per new token; overlap loop: -(slot) names a future token id
    prefix_lens: list[int]  # per request: tokens with KV before this forward
    seq_lens: list[int]  # per request: tokens with KV after it
    req_pool_indices: list[int]  # per request: its row of req_to_token
    out_cache_loc: torch.Tensor  # int64 [T], host: the KV slot of each new token
    # Rows of the T new tokens whose logits are computed, and per request its row among
    # those; None for a decode (one row per request, in order).
    logits_indices: list[int] | None
    sample_indices: list[int] | None
    # None: every row samples its argmax and nothing touches the logits first (no
    # SamplingBatchInfo is built). Else the batch's sampling tensors, the same object from
    # step to step while they do not change (`SamplingCache`), and per request the index in
    # its output of the token it samples now (seeded draws depend on it).
    sampling_info: SamplingBatchInfo | None
    sample_positions: list[int] | None
    return_logprob: bool
    top_logprobs_nums: list[int]
    # Prompt logprobs of an extend, per request: (first logits row, target token ids), None
    # if not asked; empty for a decode (a decode computes no prompt positions).
    input_logprob_specs: list[tuple[int, list[int]] | None] = field(default_factory=list)

    def extend_lens(self) -> list[int]:
        return [s - p for p, s in zip(self.prefix_lens, self.seq_lens, strict=True)]

    def positions(self) -> torch.Tensor:
        """int64 [T]: the position of each new token."""
        return torch.from_numpy(token_positions(self.prefix_lens, self.seq_lens))

    def argmax_only(self) -> bool:
        """Whether the forward's logits feed only an argmax per row (no logprobs of the
        output or of the prompt, and no sampling tensors)."""
        return (
            self.sampling_info is None
            and not self.return_logprob
            and all(spec is None for spec in self.input_logprob_specs)
        )


class SamplingCache:
    """The last batch's `SamplingBatchInfo`, handed again while the batch holds the same
    requests and nothing in it changes from step to step (no penalties, which count output
    tokens; no min-token mask still in force; no grammar mask), so the worker keeps its
    device copy instead of copying it every step."""

    def __init__(self) -> None:
        self.reqs: list[Req] = []
        self.info: SamplingBatchInfo | None = None

    def lookup(self, reqs: list[Req]) -> SamplingBatchInfo | None:
        cached = self.reqs
        if self.info is None or len(cached) != len(reqs):
            return None
        if any(a is not b for a, b in zip(cached, reqs)):
            return None
        return self.info

    def keep(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        steady = not info.has_penalties and info.min_tokens_rows is None and info.vocab_mask is None
        self.reqs, self.info = (list(reqs), info) if steady else ([], None)


@dataclass
class GenerationBatchResult:
    """What the worker returns for one forward: one entry per request of the batch."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Prompt logprobs per request (None where not asked): values for that forward's targets.
    input_token_logprobs: list[list[float] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None
    # An embedding server's pooling parts, one row per request (on the host).
    pooled: torch.Tensor | None = None


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
    # Every row sampled its argmax with nothing applied first: no request of the batch
    # needs its latest token on the host to build the next batch (`Req.needs_sync`).
    argmax_only: bool = False
    drafts: list[list[int]] | None = None  # TARGET_VERIFY: each request's draft
    built_at: float = 0.0  # perf_counter() when building it began: its step's cost ends later


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
    # TARGET_VERIFY: each request's draft, fed after its last token (speculative decoding).
    drafts: list[list[int]] | None = None

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

    @classmethod
    def verify(
        cls, reqs: list[Req], drafts: list[list[int]], out_cache_loc: torch.Tensor
    ) -> ScheduleBatch:
        """Each request's last token and its draft, at the positions its KV span just grew
        by (`KVManager.allocate_verify`)."""
        seq_lens = [r.kv.allocated_len for r in reqs]
        input_ids: list[int] = []
        for req, draft in zip(reqs, drafts, strict=True):
            input_ids.append(req.next_input_token())
            input_ids.extend(draft)
        return cls(
            ForwardMode.TARGET_VERIFY,
            reqs,
            [s - 1 - len(d) for s, d in zip(seq_lens, drafts, strict=True)],
            seq_lens,
            input_ids,
            out_cache_loc,
            drafts,
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
            drafts=self.drafts,
        )

    # ---- snapshot for the worker ---------------------------------------------------
    def model_worker_batch(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        grammar_backend: BaseGrammarBackend | None = None,
        sampling_cache: SamplingCache | None = None,
    ) -> ModelWorkerBatch:
        if self.drafts is not None:
            return self._verify_worker_batch(vocab_size, eos_token_ids, grammar_backend)
        reqs = self.reqs
        extend = self.forward_mode.is_extend()
        logits_rows: list[int] | None = None
        sample_rows: list[int] | None = None
        specs: list[tuple[int, list[int]] | None] = []
        if extend:
            logits_rows, sample_rows, specs = self._logits_rows()
        # Index of the token each row samples, from KV lengths: right even when the overlap
        # loop has not appended the previous token to `output_ids` yet.
        output_lens = [
            max(s - len(r.origin_input_ids), 0) for r, s in zip(reqs, self.seq_lens, strict=True)
        ]
        return_logprob = any(r.logprobs is not None for r in reqs)
        info = None
        if needs_sampling_info(reqs, output_lens, return_logprob):
            info = sampling_cache.lookup(reqs) if sampling_cache is not None else None
            if info is None:
                info = self._sampling_info(vocab_size, eos_token_ids, grammar_backend, output_lens)
                if sampling_cache is not None:
                    sampling_cache.keep(reqs, info)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            prefix_lens=self.prefix_lens,
            seq_lens=self.seq_lens,
            req_pool_indices=[r.kv.row for r in reqs],
            out_cache_loc=self.out_cache_loc,
            logits_indices=logits_rows,
            sample_indices=sample_rows,
            sampling_info=info,
            sample_positions=output_lens if info is not None else None,
            return_logprob=return_logprob,
            top_logprobs_nums=[r.logprobs.top_n if r.logprobs else 0 for r in reqs],
            input_logprob_specs=specs,
        )

    def _verify_worker_batch(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        grammar_backend: BaseGrammarBackend | None,
    ) -> ModelWorkerBatch:
        """A verify step runs as a decode step of one row per new token: row j of a request
        reads the request's KV up to its own position, so it computes what a decode step
        would once d_1..d_j were accepted, with the decode kernels (fused CPU layer, CUDA
        graphs). Its KV and its draft's are all written before any row attends, layer by
        layer, as for any decode batch. Row j samples output position n + j as if d_1..d_j
        were output (`srt/speculative/verify.py`)."""
        assert self.drafts is not None
        reqs, drafts = self.reqs, self.drafts
        counts = [len(d) + 1 for d in drafts]
        positions = [p + j for p, c in zip(self.prefix_lens, counts, strict=True) for j in range(c)]
        row_reqs = [r for r, c in zip(reqs, counts, strict=True) for _ in range(c)]
        output_lens = [
            pos + 1 - len(r.origin_input_ids) for r, pos in zip(row_reqs, positions, strict=True)
        ]
        return_logprob = any(r.logprobs is not None for r in reqs)
        info = None
        if needs_sampling_info(row_reqs, output_lens, return_logprob):
            vocab_mask = None
            if grammar_backend is not None and any(r.grammar for r in reqs):
                vocab_mask = DraftVocabMask(grammar_backend, [r.grammar for r in reqs], drafts)
            info = SamplingBatchInfo.from_reqs(
                draft_rows(reqs, drafts),
                vocab_size,
                "cpu",
                eos_token_ids=eos_token_ids,
                output_lens=output_lens,
                vocab_mask=vocab_mask,
            )
        return ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids,
            prefix_lens=positions,
            seq_lens=[pos + 1 for pos in positions],
            req_pool_indices=[r.kv.row for r in row_reqs],
            out_cache_loc=self.out_cache_loc,
            logits_indices=None,
            sample_indices=None,
            sampling_info=info,
            sample_positions=output_lens if info is not None else None,
            return_logprob=return_logprob,
            top_logprobs_nums=[r.logprobs.top_n if r.logprobs else 0 for r in row_reqs],
        )

    def _logits_rows(
        self,
    ) -> tuple[list[int], list[int], list[tuple[int, list[int]] | None]]:
        """An extend's logits rows (each request's last token, and its prompt positions
        where prompt logprobs are asked), each request's sampled row, and the prompt-logprob
        specs."""
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        specs: list[tuple[int, list[int]] | None] = []
        token_offset = 0
        for req, p, s in zip(self.reqs, self.prefix_lens, self.seq_lens, strict=True):
            first = s - 1
            spec = None
            if req.needs_input_logprobs():
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
        return logits_rows, sample_rows, specs

    def _sampling_info(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        grammar_backend: BaseGrammarBackend | None,
        output_lens: list[int],
    ) -> SamplingBatchInfo:
        vocab_mask = None
        if grammar_backend is not None and any(r.grammar for r in self.reqs):
            vocab_mask = VocabMask(grammar_backend, [r.grammar for r in self.reqs])
        return SamplingBatchInfo.from_reqs(
            self.reqs,
            vocab_size,
            "cpu",
            eos_token_ids=eos_token_ids,
            output_lens=output_lens,
            vocab_mask=vocab_mask,
        )


def needs_sampling_info(rows: list[Req], output_lens: list[int], return_logprob: bool) -> bool:
    """Whether a batch needs sampling tensors: some row returns logprobs or samples other
    than by the argmax of the raw logits."""
    return return_logprob or not all(
        r.samples_by_argmax(n) for r, n in zip(rows, output_lens, strict=True)
    )


def token_positions(prefix_lens: list[int], seq_lens: list[int]) -> np.ndarray:
    """int64 [T]: the position of each new token of requests growing from prefix_lens to
    seq_lens, request after request."""
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    new = np.asarray(seq_lens, dtype=np.int64) - prefix
    starts = np.cumsum(new) - new  # each request's first token among the batch's
    return np.arange(int(new.sum()), dtype=np.int64) + np.repeat(prefix - starts, new)
