"""The scheduler: waiting queue, running batch, and one iteration of the event loop.

Each `step()`:
  1. `get_next_batch_to_run`: merge the last prefill batch into the running batch, then try
     a new prefill batch (PrefillAdder over the policy-ordered waiting queue); if there is
     none, decode the running batch, retracting requests first if the KV pool is short;
  2. run it on the model worker;
  3. `process_batch_result`: append tokens, check stop conditions, cache or free finished
     requests, and emit a `BatchTokenIDOut`.

The worker is anything with `model_config`, `get_memory_pool()` and
`forward_batch_generation(ModelWorkerBatch)`: the real `ModelWorker`, or a scripted test
double. Message handling (new requests, aborts, flushes) is in `handle()`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import record_function

from constrained import create_grammar_backend
from constrained.base_grammar_backend import grammar_key
from disagg.scheduler_hooks import create_disagg
from managers.grammar_queue import GrammarQueue
from managers.io_struct import AbortReq, BatchTokenIDOut, FlushCacheReq, TokenizedGenerateReqInput
from managers.req import Req, finish_abort
from managers.schedule_batch import ScheduleBatch
from managers.schedule_policy import AddResult, PrefillAdder, SchedulePolicy
from managers.scheduler_output import SchedulerOutputMixin
from managers.scheduler_overlap import SchedulerOverlapMixin
from mem_cache.chunk_cache import ChunkCache
from mem_cache.integrity import MemoryLeakError, check_memory_integrity
from mem_cache.radix_cache import RadixCache
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class Scheduler(SchedulerOutputMixin, SchedulerOverlapMixin):
    def __init__(
        self,
        server_args: ServerArgs,
        worker: Any,
        output_sink: Callable[[BatchTokenIDOut], None],
        tokenizer: Any = None,
    ) -> None:
        self.server_args = server_args
        self.worker = worker
        self.output_sink = output_sink
        self.tokenizer = tokenizer
        cfg = worker.model_config
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.context_len: int = cfg.context_len
        self.page_size = server_args.page_size
        self.req_to_token_pool, self.allocator = worker.get_memory_pool()
        self.max_total_tokens = self.allocator.total_size()
        self.max_running_requests = self.req_to_token_pool.size
        if server_args.disable_radix_cache:
            self.tree_cache = ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)
        else:
            self.tree_cache = RadixCache(
                self.req_to_token_pool,
                self.allocator,
                page_size=self.page_size,
                eviction_policy=server_args.radix_eviction_policy,
            )
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, self.page_size)
        self.grammar_backend = create_grammar_backend(
            server_args.grammar_backend, tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.grammar_queue = GrammarQueue(server_args.grammar_compile_timeout)
        self.disagg = create_disagg(self, worker)
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.init_new_token_ratio = min(
            INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0
        )
        self.min_new_token_ratio = min(
            MIN_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0
        )
        self.new_token_ratio = self.init_new_token_ratio
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.seed_rng = random.Random(server_args.random_seed)
        self.num_retracted_reqs = 0
        self.num_aborted_reqs = 0  # cumulative, reported in the server info
        self.forward_ct = 0
        self.was_idle = True
        self.raise_on_leak = True
        self._init_overlap()
        self.memory_check: dict[str, Any] = {"ok": None, "error": None, "time": None}
        self._init_output_state()

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            self.vocab_size,
            self.eos_token_ids,
            self.page_size,
            self.grammar_backend,
        )

    # ---- messages ------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            self.flush_cache()
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else self.seed_rng.getrandbits(63)
        req = Req(
            msg.rid,
            list(msg.input_ids),
            params,
            sampling_seed=seed,
            eos_token_ids=frozenset(self.eos_token_ids),
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            extra_key=msg.extra_key,
            bootstrap=msg.bootstrap if self.disagg is not None else None,
        )
        error = self._validate(req)
        if error is not None:
            req.finished_reason = finish_abort(error, status_code=400)
            self.emit([req])
            return
        key = grammar_key(params)
        if req.bootstrap is not None:
            self._add_disagg_request(req, key)
        elif key is None:
            self.waiting_queue.append(req)
        elif self.grammar_backend is None:
            req.finished_reason = finish_abort(
                "Constrained decoding needs a tokenizer and a grammar backend.", status_code=400
            )
            self.emit([req])
        else:
            self.grammar_queue.add(req, self.grammar_backend.compile_async(key))

    def fail_request(self, req: Req, message: str, status_code: int | None = None) -> None:
        """Finish `req` with an error and tell the client (its KV is the caller's concern)."""
        req.finished_reason = finish_abort(message, status_code)
        self.emit([req])

    def _add_disagg_request(self, req: Req, key: Any) -> None:
        if key is not None or req.sampling_params.n != 1 or req.return_logprob:
            req.finished_reason = finish_abort(
                "Disaggregated requests support neither grammars, n > 1 nor logprobs.", 400
            )
            self.emit([req])
            return
        if self.server_args.disaggregation_mode == "prefill":
            # The prefill side produces only the first token; decode produces the rest.
            req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=1)
        self.disagg.add(req)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty."
        if n >= self.context_len:
            return (
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if n + 1 > self.max_total_tokens - self.page_size:
            return (
                f"The input ({n} tokens) can never fit in the KV cache pool "
                f"({self.max_total_tokens} tokens)."
            )
        if any(t < 0 or t >= self.vocab_size for t in req.origin_input_ids):
            return f"Input token ids must be in [0, {self.vocab_size})."
        return None

    def abort_request(self, msg: AbortReq) -> None:
        def hit(r: Req) -> bool:
            return msg.abort_all or r.rid == msg.rid

        gone = self.disagg.remove_if(hit) if self.disagg is not None else []
        for req in gone + self.grammar_queue.remove_if(hit):
            req.finished_reason = finish_abort("Aborted by request.")
            self.num_aborted_reqs += 1
            self.emit([req])
        for req in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(req)
            req.finished_reason = finish_abort("Aborted by request.")
            self.num_aborted_reqs += 1
            self.emit([req])
        running = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else [])
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            running += [r for r in self.last_batch.reqs if r not in running]
        for req in running:
            if hit(req) and not req.finished() and req.to_abort is None:
                req.to_abort = finish_abort("Aborted by request.")
                self.num_aborted_reqs += 1

    def flush_cache(self) -> bool:
        if self.waiting_queue or not self.running_batch.is_empty() or self.chunked_req:
            logger.warning("Cache not flushed: there are running or waiting requests.")
            return False
        # Idle: every slot is free or in the tree, so the pools can be cleared wholesale.
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        self.new_token_ratio = self.init_new_token_ratio
        logger.info("Cache flushed.")
        return True

    # ---- one iteration -------------------------------------------------------------
    def is_idle(self) -> bool:
        # A prefill batch that just ran is merged into the running batch only at the next
        # step, so until then `last_batch` still holds live requests.
        return (
            not self.waiting_queue
            and self.running_batch.is_empty()
            and self.chunked_req is None
            and self.last_batch is None
            and self.pending is None
            and not self.grammar_queue
            and not self.disagg
        )

    def step(self) -> bool:
        """One iteration of the configured loop; return whether anything ran."""
        return self.step_overlap() if self.overlap else self.step_normal()

    def step_normal(self) -> bool:
        """`event_loop_normal`'s iteration: build, run, process, in sequence."""
        with record_function("scheduler"):
            batch = self.get_next_batch_to_run()
            self.last_batch = batch
            if batch is None:
                self.idle_tracker.pause()
                self._on_maybe_idle()
                return False
            self.was_idle = False
            worker_batch = batch.model_worker_batch()
        start = time.perf_counter()
        result = self.worker.forward_batch_generation(worker_batch)
        self.idle_tracker.forward(start, time.perf_counter())
        self.forward_ct += 1
        with record_function("scheduler"):
            self.process_batch_result(batch.launch_record(), result)
        return True

    def _on_maybe_idle(self) -> None:
        if not self.was_idle and self.is_idle():
            self.was_idle = True
            self.check_memory()

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and self.is_idle():
                return
        raise RuntimeError(f"scheduler not idle after {max_steps} steps")

    def check_memory(self) -> None:
        """Prove no KV slot is leaked or double-owned; record the verdict for server info.

        Raises `MemoryLeakError` unless `raise_on_leak` is off (the server process logs the
        error and reports it through `/get_server_info` instead of dying)."""
        try:
            check_memory_integrity(self.allocator, self.tree_cache, self.running_batch.reqs)
        except MemoryLeakError as e:
            self.memory_check = {"ok": False, "error": str(e), "time": time.time()}
            logger.error("Memory integrity check failed: %s", e)
            if self.raise_on_leak:
                raise
        else:
            self.memory_check = {"ok": True, "error": None, "time": time.time()}

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.disagg is not None:
            self.disagg.poll()
        if self.grammar_queue:
            nothing_else = not self.waiting_queue and self.running_batch.is_empty()
            ready, failed = self.grammar_queue.pop_done(
                self.grammar_backend.new_matcher, block=nothing_else and not self.last_batch
            )
            self.waiting_queue.extend(ready)
            self.emit(failed)
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            last.filter_batch()
            if not last.is_empty():
                if last.forward_mode.is_mixed():
                    self.running_batch.reqs = last.reqs
                else:
                    self.running_batch.merge_batch(last)
        self.last_batch = None
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        return self.update_running_batch()

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        max_new_reqs = min(
            self.max_running_requests - len(running), self.req_to_token_pool.available_size()
        )
        if self.chunked_req is not None:
            max_new_reqs += 1  # the chunked request already holds a row
        if max_new_reqs <= 0:
            return None
        if self.chunked_req is not None:
            # Its previous chunk (maybe still in flight) goes into the tree; the next chunk
            # continues from there.
            self.tree_cache.cache_unfinished_req(self.chunked_req)
        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator.available_size() + self.tree_cache.evictable_size(),
            running,
            self.new_token_ratio,
            self.server_args.max_prefill_tokens,
            self.server_args.chunk_size,
            max_new_reqs,
            self.page_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if req.rid in self.policy.held_back and (adder.can_run_list or running):
                continue
            if adder.add_one_req(req) != AddResult.CONTINUE:
                break
        self.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        taken = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in taken]
        batch = self._new_batch(adder.can_run_list)
        batch.prepare_for_extend()
        if self.server_args.enable_mixed_chunk and running and self.chunked_req is not None:
            self._prepare_running_for_decode()
            if not self.running_batch.is_empty():
                batch.mix_with_running(self.running_batch)
                self.running_batch = self._new_batch([])
        # Put the prompts in the tree at once (their KV is computed by this batch, before any
        # later forward reads it), so requests held back this round hit it in the next one,
        # even when the overlap loop builds that round before this one's result is back.
        for req in batch.reqs:
            if not req.is_chunked:
                self.tree_cache.cache_unfinished_req(req)
        self.log_prefill_stats(adder, batch)
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        if not self._prepare_running_for_decode():
            return None
        self.running_batch.prepare_for_decode()
        self.new_token_ratio = max(
            self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
        )
        return self.running_batch

    def _prepare_running_for_decode(self) -> bool:
        """Drop finished requests and retract until the next decode step fits."""
        batch = self.running_batch
        batch.filter_batch()
        if batch.is_empty():
            return False
        retracted = self.retract_until_fits(batch)
        if retracted:
            self.waiting_queue.extend(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                "#new_token_ratio: %.4f",
                len(retracted),
                self.new_token_ratio,
            )
        return not batch.is_empty()

    def retract_until_fits(self, batch: ScheduleBatch) -> list[Req]:
        def fits(steps: int) -> bool:
            free = self.allocator.available_size() + self.tree_cache.evictable_size()
            return free >= batch.decode_tokens_needed() * steps

        if fits(1):
            return []
        retracted: list[Req] = []
        # Fewest output tokens first; among those, the longest prompt frees the most KV.
        order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        while not fits(min(RETRACT_DECODE_STEPS, 1 + len(retracted))) and len(order) > 1:
            req = order.pop(0)
            batch.reqs.remove(req)
            self.tree_cache.cache_finished_req(req)
            req.reset_for_retract()
            retracted.append(req)
        if not fits(1):
            # A lone request that cannot get one more slot can never finish.
            req = order[0]
            req.finished_reason = finish_abort(
                f"The KV cache pool ({self.max_total_tokens} tokens) is too small for this "
                f"request ({req.seq_len()} tokens so far)."
            )
            batch.reqs.remove(req)
            self.tree_cache.cache_finished_req(req)
            self.emit([req])
        self.num_retracted_reqs += len(retracted)
        total_decoded = sum(len(r.output_ids) for r in batch.reqs)
        total_max_new = sum(r.sampling_params.max_new_tokens or 0 for r in batch.reqs) or 1
        ratio = (total_decoded + RETRACT_DECODE_STEPS * len(batch.reqs)) / total_max_new
        self.new_token_ratio = max(self.new_token_ratio, min(1.0, ratio))
        return retracted
