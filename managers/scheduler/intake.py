"""`Intake`: requests into the scheduler, and aborts.

    TokenizedGenerateReqInput ──validate──▶ waiting
                                   ├─(has a grammar)──▶ grammar queue ──(compiled)──▶ waiting
                                   ├─(has bootstrap info)──▶ the disaggregation side
                                   └─(invalid)──▶ finished with a 400

An abort finishes a queued request at once; a request already admitted is marked `to_abort`
and finished by its next result, so its KV is released where it is known to be unused.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

from constrained.base_grammar_backend import grammar_key
from managers.errors import RequestError
from managers.io_struct import AbortReq, TokenizedGenerateReqInput, finish_abort
from managers.req import Req
from managers.scheduler.grammar_queue import GrammarQueue
from managers.validation import check_prompt

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarBackend
    from disagg.port import DisaggSide
    from managers.scheduler.output import Output
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager
    from srt.server_args import ServerArgs

ABORTED = "Aborted by request."


class Intake:
    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        output: Output,
        disagg: DisaggSide,
        server_args: ServerArgs,
        model_config: Any,
        grammar_backend: BaseGrammarBackend | None,
    ) -> None:
        self.queues = queues
        self.kv = kv
        self.output = output
        self.context_len: int = model_config.context_len
        self.vocab_size: int = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.disaggregation_mode = server_args.disaggregation_mode
        self.grammar_backend = grammar_backend
        self.grammar_queue = GrammarQueue(server_args.grammar_compile_timeout)
        self.seed_rng = random.Random(server_args.random_seed)
        self.disagg = disagg
        self.num_aborted_reqs = 0  # cumulative, reported in the server info

    def __bool__(self) -> bool:
        """Whether requests wait here (for a grammar or a disaggregation peer)."""
        return bool(self.grammar_queue) or bool(self.disagg)

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
        )
        error = self._refusal(req)
        if error is not None:
            self.output.fail(req, error, 400)
            return
        key = grammar_key(params)
        if req.disagg is not None:
            if self.disaggregation_mode == "prefill":
                # The prefill side produces only the first token; decode produces the rest.
                req.sampling_params = dataclasses.replace(params, max_new_tokens=1)
            self.disagg.add(req)
        elif key is None:
            self.queues.waiting.append(req)
        else:
            assert self.grammar_backend is not None  # `_refusal` checked it
            self.grammar_queue.add(req, self.grammar_backend.compile_async(key))

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
        has_grammar = grammar_key(req.sampling_params) is not None
        if req.disagg is not None and (
            has_grammar or req.sampling_params.n != 1 or req.logprobs is not None
        ):
            return "Disaggregated requests support neither grammars, n > 1 nor logprobs."
        if has_grammar and self.grammar_backend is None:
            return "Constrained decoding needs a tokenizer and a grammar backend."
        return None

    def poll(self) -> None:
        """Once per step: let the disaggregation side move its requests on, move requests
        whose grammar compiled to the waiting queue, and fail the invalid ones."""
        self.disagg.poll()
        if not self.grammar_queue:
            return
        assert self.grammar_backend is not None
        q = self.queues
        # Nothing else can run: wait briefly for a compile instead of spinning.
        block = not q.waiting and not q.running and q.last_batch is None
        ready, failed = self.grammar_queue.pop_done(self.grammar_backend.new_matcher, block)
        self.queues.waiting.extend(ready)
        self.output.emit(failed)

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
        self.output.fail(req, ABORTED)
