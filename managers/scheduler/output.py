"""`Output`: apply a forward's result to its requests, tell the clients, and keep the stats.

`process` walks a `BatchLaunch` (frozen when the batch was launched) with its
`GenerationBatchResult`: it drops samples of requests retracted or finished since launch,
appends tokens and logprobs, checks stop conditions, hands finished requests' KV to the tree
(or to the disaggregation side) and emits one `BatchTokenIDOut` for the step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from managers.io_struct import finish_abort, finish_length, finish_matched
from srt.layers.pooler import add_part, finish_vector
from srt.speculative.verify import accepted_length

if TYPE_CHECKING:
    from collections.abc import Callable

    from managers.req import Req
    from managers.schedule_batch import BatchLaunch, GenerationBatchResult
    from managers.scheduler.emitter import Emitter
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager
    from srt.configs.pooling import PoolingConfig
    from srt.speculative.controller import DraftController

logger = logging.getLogger(__name__)


class SpecStats:
    """Speculative decoding so far: verify steps of a request, draft tokens, accepted ones,
    and tokens produced (accepted + one per step)."""

    def __init__(self) -> None:
        self.steps = 0
        self.drafted = 0
        self.accepted = 0
        self.produced = 0

    def add(self, drafted: int, accepted: int, produced: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.produced += produced

    def accept_length(self) -> float:
        """Tokens a request gains per verify step (1.0: as many as decoding)."""
        return self.produced / self.steps if self.steps else 0.0


class IdleTracker:
    """How long the model worker waited for the scheduler between consecutive forwards."""

    def __init__(self) -> None:
        self.idle_s = 0.0
        self.busy_s = 0.0
        self._prev_end: float | None = None
        self._mark = (0.0, 0.0)

    def forward(self, start: float, end: float) -> None:
        """Normal loop: a forward ran from `start` to `end`."""
        if self._prev_end is not None:
            self.idle_s += start - self._prev_end
        self.busy_s += end - start
        self._prev_end = end

    def record(self, wait_s: float, forward_s: float, continuous: bool) -> None:
        """Overlap loop: the worker thread's own wait and forward times."""
        if continuous:
            self.idle_s += wait_s
        self.busy_s += forward_s

    def pause(self) -> None:
        """No batch this iteration: the gap until the next forward is not the scheduler's."""
        self._prev_end = None

    def fraction_since_mark(self) -> float:
        idle = self.idle_s - self._mark[0]
        busy = self.busy_s - self._mark[1]
        self._mark = (self.idle_s, self.busy_s)
        return idle / (idle + busy) if idle + busy > 0 else 0.0


class Output:
    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        emitter: Emitter,
        take_finished: Callable[[Req], bool],
        decode_log_interval: int,
        pooling: PoolingConfig | None = None,
        drafts: DraftController | None = None,
    ) -> None:
        """`take_finished(req)`: True where the disaggregation side keeps a finished request
        (a PD prefill request until its KV reached the decode server). `pooling`: an
        embedding server's, whose forwards return pooling parts instead of samples.
        `drafts`: speculative decoding's controller, told what each verify step accepted."""
        self.pooling = pooling
        self.drafts = drafts
        self.spec = SpecStats()
        self._spec_mark = (0, 0)  # SpecStats (steps, produced) at the last decode log line
        self.queues = queues
        self.kv = kv
        self.emitter = emitter
        self.take_finished = take_finished
        self.decode_log_interval = decode_log_interval
        self.idle_tracker = IdleTracker()
        self.forward_ct = 0
        self.num_generated_tokens = 0  # cumulative, for the throughput metric
        self.last_cache_hit_rate = 0.0
        self._decode_tic = time.perf_counter()
        self._decode_tokens_since_log = 0

    # ---- results -------------------------------------------------------------------
    def process(self, batch: BatchLaunch, result: GenerationBatchResult) -> None:
        if batch.drafts is not None:
            self.process_verify(batch, result)
            return
        emit: list[Req] = []
        extend = batch.forward_mode.is_extend()
        for i, req in enumerate(batch.reqs):
            if batch.placeholders is not None and req.pending_token == batch.placeholders[i]:
                req.pending_token = None
            if req.retract_count != batch.retract_counts[i]:
                continue  # retracted after launch: this sample is dropped, resume redoes it
            if extend:
                self._apply_input_logprobs(req, result, i, batch.prefix_lens[i])
                if req.embed is not None:
                    self._add_pooling_part(req, result, i, batch.prefix_lens[i])
            if req.finished():
                continue  # finished by an earlier result (overlap: this sample is extra)
            if req.to_abort is not None and batch.chunked[i]:
                req.finished_reason = req.to_abort
                if req is self.queues.chunked:
                    self.queues.chunked = None
                req.is_chunked = False
            elif batch.chunked[i]:
                continue  # a non-final chunk; the next build caches it in the tree
            if req.logprobs is not None:
                req.logprobs.input_done = True
            if not req.finished():
                self._append_token(req, result, i)
            if req.finished():
                self._finish(req, emit)
            elif req.stream or extend:
                # Every request reports its first token (time to first token is measured
                # for all); after that only streaming ones report per step.
                emit.append(req)
        self.num_generated_tokens += len(batch.reqs)
        if not extend:
            self._decode_tokens_since_log += len(batch.reqs)
            if self.forward_ct % self.decode_log_interval == 0:
                self.log_decode_stats()
        self.emitter.emit(emit)

    def _finish(self, req: Req, emit: list[Req]) -> None:
        # A prefill-side request of a PD pair stays with the disaggregation side until its KV
        # reached the decode server; any other is done here.
        if not (req.output_ids and self.take_finished(req)):
            self.kv.cache_finished(req)
            emit.append(req)
        if self.drafts is not None:
            self.drafts.proposer.on_finished(req.output_ids)

    def process_verify(self, batch: BatchLaunch, result: GenerationBatchResult) -> None:
        """A verify step: each request keeps its samples up to the first rejected draft
        (`srt/speculative/verify.py`), appended one by one with their stop checks, and gives
        back the KV slots of what it did not keep."""
        assert batch.drafts is not None and self.drafts is not None
        emit: list[Req] = []
        row = 0
        for req, draft in zip(batch.reqs, batch.drafts, strict=True):
            first, row = row, row + len(draft) + 1
            if req.finished():
                continue  # failed or aborted since launch; its KV is released already
            accepted = accepted_length(draft, result.next_token_ids[first:row])
            before = len(req.output_ids)
            for j in range(accepted + 1):
                self._append_token(req, result, first + j)
                if req.finished():
                    break
            # Only the positions of tokens now in the request keep their KV.
            self.kv.trim(req.kv, req.seq_len() - 1)
            if req.spec is not None:
                self.drafts.observe(req.spec, len(draft), accepted)
            self.spec.add(len(draft), accepted, len(req.output_ids) - before)
            self.num_generated_tokens += len(req.output_ids) - before
            self._decode_tokens_since_log += len(req.output_ids) - before
            if req.finished():
                self._finish(req, emit)
            elif req.stream:
                emit.append(req)
        if self.forward_ct % self.decode_log_interval == 0:
            self.log_decode_stats()
        self.emitter.emit(emit)

    def _add_pooling_part(
        self, req: Req, result: GenerationBatchResult, i: int, prefix_len: int
    ) -> None:
        assert req.embed is not None and self.pooling is not None and result.pooled is not None
        req.embed.acc = add_part(self.pooling.method, req.embed.acc, result.pooled[i], prefix_len)

    def _append_token(self, req: Req, result: GenerationBatchResult, i: int) -> None:
        """Append the token sampled by row i (none for a prefill-only request), then check
        stops."""
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = finish_length(0)
            if req.embed is not None:
                self._finish_embedding(req)
            return
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        if req.logprobs is not None and result.next_token_logprobs is not None:
            top = result.next_top_logprobs[i] if result.next_top_logprobs is not None else None
            req.logprobs.add_output(result.next_token_logprobs[i], token, top)
        if req.grammar is None or self._advance_grammar(req, token):
            self.emitter.check_finished(req)

    def _finish_embedding(self, req: Req) -> None:
        assert req.embed is not None and self.pooling is not None
        pooling = self.pooling
        req.embed.vector = finish_vector(
            pooling.method,
            req.embed.acc,
            len(req.origin_input_ids),
            req.embed.dimensions,
            pooling.normalize,
        )

    def _advance_grammar(self, req: Req, token: int) -> bool:
        """Accept `token` into the request's matcher; finish the request when the grammar is
        complete. Returns False when the request was finished here."""
        assert req.grammar is not None
        if not req.grammar.accept_token(token):
            # The mask allowed only grammar tokens, so this means a backend bug; never
            # produce invalid output silently.
            req.finished_reason = finish_abort(f"Token {token} violates the request's grammar.")
            logger.error("Request %s: token %d rejected by its grammar.", req.rid, token)
            return False
        if req.grammar.is_terminated():
            req.finished_reason = finish_matched(token)
            return False
        return True

    @staticmethod
    def _apply_input_logprobs(
        req: Req, result: GenerationBatchResult, i: int, prefix_len: int
    ) -> None:
        if not req.needs_input_logprobs() or result.input_token_logprobs is None:
            return
        values = result.input_token_logprobs[i]
        if values is None:
            return
        tops = result.input_top_logprobs[i] if result.input_top_logprobs else None
        assert req.logprobs is not None
        req.logprobs.add_input(values, tops, prefix_len, req.origin_input_ids)

    # ---- logging -------------------------------------------------------------------
    def log_prefill_stats(self, new_seqs: int, new_tokens: int, hit_tokens: int) -> None:
        seen = new_tokens + hit_tokens
        self.last_cache_hit_rate = hit_tokens / seen if seen else 0.0
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            new_seqs,
            new_tokens,
            hit_tokens,
            self.kv.token_usage(),
            len(self.queues.running),
            len(self.queues.waiting),
        )

    def log_decode_stats(self) -> None:
        now = time.perf_counter()
        throughput = self._decode_tokens_since_log / max(now - self._decode_tic, 1e-9)
        self._decode_tic, self._decode_tokens_since_log = now, 0
        spec = ""
        if self.drafts is not None:
            steps, produced = (
                self.spec.steps - self._spec_mark[0],
                self.spec.produced - self._spec_mark[1],
            )
            self._spec_mark = (self.spec.steps, self.spec.produced)
            spec = f", accept len: {produced / steps if steps else 0.0:.2f}"
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, worker idle: %.1f%%%s",
            len(self.queues.running),
            self.kv.used_tokens(),
            self.kv.token_usage(),
            throughput,
            len(self.queues.waiting),
            100 * self.idle_tracker.fraction_since_mark(),
            spec,
        )
