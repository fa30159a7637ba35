"""`Intake`: requests into the scheduler, admission limits, time limits, and aborts.

    TokenizedGenerateReqInput ──validate──▶ waiting
                                   ├─(has a grammar)──▶ grammar queue ──(compiled)──▶ waiting
                                   ├─(has bootstrap info)──▶ the disaggregation side
                                   ├─(invalid)──▶ finished with a 400
                                   └─(the queue is full)──▶ finished with a 503

Queued means not admitted yet: waiting, in the grammar queue, or held by the disaggregation
side. `--max-queued-requests` and `--max-queued-tokens` (prompt tokens) bound them (queued
requests that free running rows will take next step do not count against the first); a
request that would pass a bound is refused with a 503 at once (the HTTP layer adds
`Retry-After`).
With priority scheduling, a newcomer more urgent than the least urgent never-admitted waiting
request takes its place, and that one gets the 503 instead. Bounds apply to arrivals only: a
retracted request always goes back to the queue.

An abort or an expired deadline (`Deadlines`) finishes a queued request at once; a request
already admitted is marked `to_abort` and finished by its next result, so its KV is released
where it is known to be unused.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from constrained.base_grammar_backend import GrammarKey, grammar_key
from managers.errors import RequestError
from managers.io_struct import AbortReq, FinishReason, TokenizedGenerateReqInput, finish_abort
from managers.req import EmbedState, Req
from managers.scheduler.grammar_queue import GrammarQueue
from managers.scheduler.policy import urgency
from managers.validation import check_prompt, embedding_mismatch

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarBackend
    from disagg.port import DisaggSide
    from managers.scheduler.deadlines import Deadlines
    from managers.scheduler.emitter import Emitter
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager
    from srt.configs.pooling import PoolingConfig
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

ABORTED = "Aborted by request."
OVERLOADED = 503
# At most one "queue full" warning per this many seconds (a storm refuses thousands).
REFUSAL_LOG_INTERVAL_S = 10.0


class Intake:
    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        emitter: Emitter,
        disagg: DisaggSide,
        server_args: ServerArgs,
        model_config: Any,
        grammar_backend: BaseGrammarBackend | None,
        deadlines: Deadlines,
        pooling: PoolingConfig | None = None,
    ) -> None:
        """`pooling`: an embedding server's (`--is-embedding`), else None."""
        self.queues = queues
        self.pooling = pooling
        self.kv = kv
        self.emitter = emitter
        self.context_len: int = model_config.context_len
        self.vocab_size: int = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.disaggregation_mode = server_args.disaggregation_mode
        self.grammar_backend = grammar_backend
        # The deadlines' clock: rank 0's step time on every tensor-parallel rank.
        self.grammar_queue = GrammarQueue(server_args.grammar_compile_timeout, deadlines.clock)
        self.seed_rng = random.Random(server_args.random_seed)
        self.disagg = disagg
        self.deadlines = deadlines
        self.max_queued_requests = server_args.max_queued_requests
        self.max_queued_tokens = server_args.max_queued_tokens
        self.max_pending_grammars = server_args.grammar_max_pending_per_client
        self.by_priority = None
        if server_args.enable_priority_scheduling:
            self.by_priority = urgency(server_args.schedule_low_priority_values_first)
        self.num_aborted_reqs = 0  # cumulative, reported in the server info
        self.num_refused_reqs = 0  # cumulative: refused because the queue was full
        self.num_timed_out_reqs = 0  # cumulative
        self._refusal_logged_at = -REFUSAL_LOG_INTERVAL_S

    def __bool__(self) -> bool:
        """Whether requests wait here (for a grammar or a disaggregation peer)."""
        return bool(self.grammar_queue) or bool(self.disagg)

    def _embed_state(self, msg: TokenizedGenerateReqInput) -> EmbedState | None:
        if msg.embed is None:
            return None
        every_token = self.pooling is not None and self.pooling.every_token()
        return EmbedState(msg.embed.dimensions, every_token)

    def add(self, msg: TokenizedGenerateReqInput) -> None:
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else self.seed_rng.getrandbits(63)
        req = Req(
            msg.rid,
            list(msg.input_ids),
            params,
            sampling_seed=seed,
            eos_token_ids=self.eos_token_ids,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            extra_key=msg.extra_key,
            bootstrap=msg.bootstrap if self.disaggregation_mode != "null" else None,
            priority=msg.priority,
            timeout=msg.timeout,
            embed=self._embed_state(msg),
        )
        error = self._refusal(req)
        if error is not None:
            self.emitter.fail(req, error, 400)
            return
        key = grammar_key(params)
        if key is not None and self._over_grammar_cap(msg.client, key):
            cap = self.max_pending_grammars
            message = (
                f"This client already waits for {cap} grammars to compile; retry when one "
                "is ready (--grammar-max-pending-per-client)."
            )
            self.emitter.fail(req, message, 429)
            return
        if not self._make_room(req):
            return
        self.deadlines.arrived(req)
        if req.disagg is not None:
            if self.disaggregation_mode == "prefill":
                # The prefill side produces only the first token; decode produces the rest.
                req.sampling_params = dataclasses.replace(params, max_new_tokens=1)
            self.disagg.add(req)
        elif key is None:
            self.queues.waiting.append(req)
        else:
            assert self.grammar_backend is not None  # `_refusal` checked it
            future = self.grammar_backend.compile_async(key)
            self.grammar_queue.add(req, future, msg.client)

    def _over_grammar_cap(self, client: str | None, key: GrammarKey) -> bool:
        cap = self.max_pending_grammars
        return cap > 0 and client is not None and self.grammar_queue.pending_for(client, key) >= cap

    def _refusal(self, req: Req) -> str | None:
        """Why the request cannot be served, or None."""
        try:
            check_prompt(req.origin_input_ids, self.context_len, self.vocab_size)
        except RequestError as e:
            return e.message
        n = len(req.origin_input_ids)
        if n + 1 > self.kv.total_tokens - self.kv.page_size:
            return (
                f"The input ({n} tokens) can never fit in the KV cache pool "
                f"({self.kv.total_tokens} tokens)."
            )
        if (req.embed is None) != (self.pooling is None):
            # The main process checks this first; a router or another client may not.
            return embedding_mismatch(self.pooling is not None)
        has_grammar = grammar_key(req.sampling_params) is not None
        if req.disagg is not None and (
            has_grammar or req.sampling_params.n != 1 or req.logprobs is not None
        ):
            return "Disaggregated requests support neither grammars, n > 1 nor logprobs."
        if has_grammar and self.grammar_backend is None:
            return "Constrained decoding needs a tokenizer and a grammar backend."
        return None

    # ---- admission limits ----------------------------------------------------------
    def num_queued(self) -> int:
        """Requests not admitted yet: waiting, compiling a grammar, or with the
        disaggregation side (waiting for their peer)."""
        return len(self.queues.waiting) + len(self.grammar_queue) + len(self.disagg)

    def num_queued_tokens(self) -> int:
        waiting = self.queues.waiting + [e.req for e in self.grammar_queue.entries]
        return sum(len(r.origin_input_ids) for r in waiting)

    def _overload(self, req: Req, leaving: Req | None = None) -> str | None:
        """Why `req` may not queue now (with `leaving` gone from the queue), or None."""
        if self.max_queued_requests is not None:
            n = self.num_queued() - (leaving is not None)
            # Requests the next step admits into free rows are no backlog: a burst that
            # arrives between two steps fills the free rows and the queue, not the queue alone.
            if n - self.kv.free_rows() >= self.max_queued_requests:
                return (
                    f"The server is overloaded: {n} requests are waiting for admission "
                    f"(--max-queued-requests {self.max_queued_requests}); retry later."
                )
        if self.max_queued_tokens is not None:
            tokens = self.num_queued_tokens()
            if leaving is not None:
                tokens -= len(leaving.origin_input_ids)
            # A bound on the backlog, not on one prompt: an empty queue takes any request.
            if tokens > 0 and tokens + len(req.origin_input_ids) > self.max_queued_tokens:
                return (
                    f"The server is overloaded: {tokens} prompt tokens are waiting for "
                    f"admission (--max-queued-tokens {self.max_queued_tokens}); retry later."
                )
        return None

    def _make_room(self, req: Req) -> bool:
        """Whether `req` may queue; when not, it is finished with a 503. A more urgent
        newcomer displaces the least urgent never-admitted waiting request instead."""
        reason = self._overload(req)
        if reason is None:
            return True
        victim = self._least_urgent_waiting()
        if (
            victim is not None
            and self.by_priority is not None
            and self.by_priority(victim) > self.by_priority(req)
            and self._overload(req, leaving=victim) is None
        ):
            self.queues.waiting.remove(victim)
            self._refuse(
                victim,
                "The server is overloaded: a request of higher priority took "
                "this one's place in the queue; retry later.",
            )
            return True
        self._refuse(req, reason)
        return False

    def _least_urgent_waiting(self) -> Req | None:
        if self.by_priority is None:
            return None
        key = self.by_priority
        candidates = [r for r in self.queues.waiting if r.admission.admitted is None]
        # The least urgent; among equals, the latest arrival.
        return max(candidates, key=lambda r: (key(r), r.admission.arrival), default=None)

    def _refuse(self, req: Req, reason: str) -> None:
        self.num_refused_reqs += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged_at = now
            logger.warning("%s Refused so far: %d.", reason, self.num_refused_reqs)
        self.emitter.fail(req, reason, OVERLOADED)

    # ---- per step ------------------------------------------------------------------
    def poll(self, grammar_done: list[int] | None = None) -> None:
        """Once per step: finish requests past a deadline, let the disaggregation side move
        its requests on, move requests whose grammar compiled to the waiting queue, and fail
        the invalid ones.

        `grammar_done`: which compiles count as done (`grammar_done_seqs` on tensor-parallel
        rank 0, the same list on every rank); None decides here, as at tp=1."""
        for req, reason in self.deadlines.expired():
            self.num_timed_out_reqs += 1
            logger.info("Request %s: %s", req.rid, reason.message)
            self._finish(req, reason)
        self.disagg.poll()
        if not self.grammar_queue:
            return
        assert self.grammar_backend is not None
        ready, failed = self.grammar_queue.pop_done(
            self.grammar_backend.new_matcher, self._nothing_else_to_run(), grammar_done
        )
        self.queues.waiting.extend(ready)
        self.emitter.emit(failed)

    def grammar_done_seqs(self, may_wait: bool) -> list[int]:
        """Tensor-parallel rank 0, before its step input goes out: the compiles that count as
        done this step. With nothing else to run (and `may_wait`), it waits briefly for one
        first, like `poll` at tp=1."""
        if not self.grammar_queue:
            return []
        return self.grammar_queue.done_seqs(may_wait and self._nothing_else_to_run())

    def _nothing_else_to_run(self) -> bool:
        """Nothing but compiles to wait for: wait briefly for one instead of spinning."""
        q = self.queues
        return not q.waiting and not q.running and q.last_batch is None

    def abort(self, msg: AbortReq) -> None:
        def hit(r: Req) -> bool:
            return msg.abort_all or r.rid == msg.rid

        for req in self.disagg.remove_if(hit) + self.grammar_queue.remove_if(hit):
            self._abort_queued(req)
        q = self.queues
        for req in [r for r in q.waiting if hit(r)]:
            q.waiting.remove(req)
            self._abort_queued(req)
        for req in q.in_flight():
            if hit(req) and not req.finished() and req.to_abort is None:
                req.to_abort = finish_abort(ABORTED)
                self.num_aborted_reqs += 1

    def _abort_queued(self, req: Req) -> None:
        self.num_aborted_reqs += 1
        self.emitter.fail(req, ABORTED)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Finish one request where it is: at once while queued (it holds no KV, or the
        disaggregation side releases it), at its next result once admitted."""

        def this(r: Req) -> bool:
            return r is req

        q = self.queues
        queued = self.disagg.remove_if(this) + self.grammar_queue.remove_if(this)
        if not queued and req in q.waiting:  # identity: a Req has no __eq__
            q.waiting.remove(req)
            queued = [req]
        if queued:
            req.finished_reason = reason
            self.emitter.emit([req])
        elif req.to_abort is None and any(r is req for r in q.in_flight()):
            req.to_abort = reason
