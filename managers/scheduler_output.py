"""The scheduler's result side: apply a forward's tokens to requests, emit, and log.

Kept apart from scheduler.py so the loop and admission logic read in one sitting.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disagg.base import KVPoll
from managers.io_struct import (
    BatchTokenIDOut,
    LogprobDelta,
    ReqOutput,
    finish_abort,
    finish_length,
    finish_matched,
)
from managers.req import Req

if TYPE_CHECKING:
    from managers.schedule_batch import BatchLaunch, ScheduleBatch
    from managers.schedule_policy import PrefillAdder

logger = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    """What the worker returns for one forward: one entry per request of the batch."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Prompt logprobs per request (None where not asked): values for that forward's targets.
    input_token_logprobs: list[list[float] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None


class SchedulerOutputMixin:
    def _init_output_state(self: Any) -> None:
        self.decode_tic = time.perf_counter()
        self.decode_tokens_since_log = 0
        self.num_generated_tokens = 0  # cumulative, for the throughput metric
        self.last_cache_hit_rate = 0.0

    def process_batch_result(self: Any, batch: BatchLaunch, result: GenerationBatchResult) -> None:
        emit: list[Req] = []
        extend = batch.forward_mode.is_extend()
        for i, req in enumerate(batch.reqs):
            if batch.placeholders is not None and req.pending_token == batch.placeholders[i]:
                req.pending_token = None
            if req.retract_count != batch.retract_counts[i]:
                continue  # retracted after launch: this sample is dropped, resume redoes it
            if extend:
                self._apply_input_logprobs(req, result, i, batch.prefix_lens[i])
            if req.finished():
                continue  # finished by an earlier result (overlap: this sample is extra)
            if req.to_abort is not None and batch.chunked[i]:
                req.finished_reason = req.to_abort
                if req is self.chunked_req:
                    self.chunked_req = None
                req.is_chunked = False
            elif batch.chunked[i]:
                continue  # a non-final chunk; the next build caches it in the tree
            req.input_logprobs_done = True
            if not req.finished():
                self._append_token(req, result, i)
            if req.finished() and req.kv_poll == KVPoll.WaitingForInput and req.output_ids:
                self.disagg.on_prefilled(req)  # finishes once its KV reached decode
            elif req.finished():
                self.tree_cache.cache_finished_req(req)
                emit.append(req)
            elif req.stream or extend:
                # Every request reports its first token (time to first token is measured
                # for all); after that only streaming ones report per step.
                emit.append(req)
        self.num_generated_tokens += len(batch.reqs)
        if not extend:
            self.decode_tokens_since_log += len(batch.reqs)
            if self.forward_ct % self.server_args.decode_log_interval == 0:
                self.log_decode_stats()
        self.emit(emit)

    def _append_token(self: Any, req: Req, result: GenerationBatchResult, i: int) -> None:
        """Append the sampled token (none for a prefill-only request), then check stops."""
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = finish_length(0)
            return
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        if req.return_logprob and result.next_token_logprobs is not None:
            req.output_token_logprobs.append((result.next_token_logprobs[i], token))
            if req.top_logprobs_num and result.next_top_logprobs is not None:
                req.output_top_logprobs.append(result.next_top_logprobs[i])
        if req.grammar is None or self._advance_grammar(req, token):
            req.check_finished(self.context_len, self._tail_text)

    def _advance_grammar(self: Any, req: Req, token: int) -> bool:
        """Accept `token` into the request's matcher; finish the request when the grammar is
        complete. Returns False when the request was finished here."""
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

    def _apply_input_logprobs(
        self: Any, req: Req, result: GenerationBatchResult, i: int, prefix_len: int
    ) -> None:
        if req.input_logprobs_done or result.input_token_logprobs is None:
            return
        values = result.input_token_logprobs[i]
        if values is None:
            return
        if prefix_len == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.origin_input_ids[0]))
            req.input_top_logprobs.append(None)
        lo = max(prefix_len, req.logprob_start_len - 1)
        targets = req.origin_input_ids[lo + 1 : lo + 1 + len(values)]
        req.input_token_logprobs.extend(zip(values, targets, strict=True))
        tops = result.input_top_logprobs[i] if result.input_top_logprobs else None
        if req.top_logprobs_num:
            req.input_top_logprobs.extend(tops or [[] for _ in values])

    def _tail_text(self: Any, req: Req, n: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_ids[-n:], skip_special_tokens=False)

    def emit(self: Any, reqs: list[Req]) -> None:
        if not reqs:
            return
        outputs: list[ReqOutput] = []
        for req in reqs:
            out = ReqOutput(
                rid=req.rid,
                new_token_ids=req.output_ids[req.sent_output_len :],
                finish_reason=req.finished_reason if req.finished() else None,
                prompt_tokens=len(req.origin_input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                decode_options=req.decode_options(),
            )
            req.sent_output_len = len(req.output_ids)
            if req.return_logprob:
                o, n_in = req.sent_output_logprob_len, req.sent_input_logprob_len
                out.logprobs = LogprobDelta(
                    output_token_logprobs=req.output_token_logprobs[o:],
                    output_top_logprobs=req.output_top_logprobs[o:],
                    input_token_logprobs=req.input_token_logprobs[n_in:],
                    input_top_logprobs=req.input_top_logprobs[n_in:],
                )
                req.sent_output_logprob_len = len(req.output_token_logprobs)
                req.sent_input_logprob_len = len(req.input_token_logprobs)
            outputs.append(out)
        self.output_sink(BatchTokenIDOut(outputs))

    # ---- logging -------------------------------------------------------------------
    def token_usage(self: Any) -> float:
        used = (
            self.max_total_tokens
            - self.allocator.available_size()
            - self.tree_cache.evictable_size()
        )
        return used / self.max_total_tokens

    def log_prefill_stats(self: Any, adder: PrefillAdder, batch: ScheduleBatch) -> None:
        seen = adder.log_input_tokens + adder.log_hit_tokens
        self.last_cache_hit_rate = adder.log_hit_tokens / seen if seen else 0.0
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(adder.can_run_list),
            adder.log_input_tokens,
            adder.log_hit_tokens,
            self.token_usage(),
            len(self.running_batch.reqs),
            len(self.waiting_queue),
        )

    def log_decode_stats(self: Any) -> None:
        now = time.perf_counter()
        throughput = self.decode_tokens_since_log / max(now - self.decode_tic, 1e-9)
        self.decode_tic, self.decode_tokens_since_log = now, 0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, worker idle: %.1f%%",
            len(self.running_batch.reqs),
            self.max_total_tokens - self.allocator.available_size(),
            self.token_usage(),
            throughput,
            len(self.waiting_queue),
            100 * self.idle_tracker.fraction_since_mark(),
        )
