"""`PrefillPlanner`: the next prefill batch from the policy-ordered waiting queue.

The policy (policy.py) matches every waiting request against the tree and orders the queue;
`PrefillAdder` admits requests under the total-token, prefill-token and chunk budgets, the
total-token budget reserving what running requests may still grow by (`NewTokenRatio`); the
prefill-token budget is `ServerArgs.prefill_token_budget` of the new tokens waiting (on CPU a
long queue gets larger batches). The chunked request, if any, continues first. With
`--enable-mixed-chunk` the running decodes ride along with every prefill batch (MIXED), as in
SGLang, and their tokens count against the prefill-token budget.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from managers.schedule_batch import ScheduleBatch
from managers.scheduler.policy import AddResult, PrefillAdder, SchedulePolicy, urgency

if TYPE_CHECKING:
    from managers.scheduler.deadlines import Deadlines
    from managers.scheduler.decode import DecodePlanner
    from managers.scheduler.output import Output
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager
    from srt.server_args import ServerArgs


class PrefillPlanner:
    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        decode: DecodePlanner,
        output: Output,
        server_args: ServerArgs,
        deadlines: Deadlines,
    ) -> None:
        self.queues = queues
        self.kv = kv
        self.decode = decode
        self.output = output
        self.deadlines = deadlines
        by_priority = None
        if server_args.enable_priority_scheduling:
            by_priority = urgency(server_args.schedule_low_priority_values_first)
        self.policy = SchedulePolicy(server_args.schedule_policy, kv, by_priority)
        self.server_args = server_args
        # The budget of an empty and of an endless queue: equal (GPU, or pinned by
        # --max-prefill-tokens), the queue need not be counted each round.
        self.budget_range = (
            server_args.prefill_token_budget(0),
            server_args.prefill_token_budget(sys.maxsize),
        )
        self.chunk_size = server_args.chunk_size
        self.mixed_chunk = server_args.enable_mixed_chunk

    def build(self) -> ScheduleBatch | None:
        q = self.queues
        if not q.waiting and q.chunked is None:
            return None
        max_new_reqs = min(self.kv.max_rows - len(q.running), self.kv.free_rows())
        if q.chunked is not None:
            max_new_reqs += 1  # the chunked request already holds a row
        if max_new_reqs <= 0:
            return None
        if q.chunked is not None:
            # Its previous chunk (maybe still in flight) goes into the tree; the next chunk
            # continues from there.
            self.kv.cache_unfinished(q.chunked)
        adder = self._admit(max_new_reqs)
        q.chunked = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        taken = {id(r) for r in adder.can_run_list}
        q.waiting = [r for r in q.waiting if id(r) not in taken]
        reqs = adder.can_run_list
        loc = self.kv.allocate_extend([r.kv for r in reqs], [len(r.fill_ids) for r in reqs])
        batch = ScheduleBatch.extend(reqs, loc)
        for req, prefix_len in zip(reqs, batch.prefix_lens, strict=True):
            if req.cached_tokens is None:
                req.cached_tokens = prefix_len  # first admission: what the cache saved
            self.deadlines.admitted(req)
        if self.mixed_chunk and q.running:
            decodes = self.decode.build(decay=False)
            if decodes is not None:
                batch.mix(decodes)
                q.running = []
        # Put the prompts in the tree at once (their KV is computed by this batch, before any
        # later forward reads it), so requests held back this round hit it in the next one,
        # even when the overlap loop builds that round before this one's result is back.
        for req in batch.reqs:
            if not req.is_chunked:
                self.kv.cache_unfinished(req)
        self.output.log_prefill_stats(
            len(adder.can_run_list), adder.log_input_tokens, adder.log_hit_tokens
        )
        return batch

    def _admit(self, max_new_reqs: int) -> PrefillAdder:
        q = self.queues
        self.policy.calc_priority(q.waiting)
        budget = self.prefill_budget()
        adder = PrefillAdder(
            self.kv,
            self.kv.available_tokens(),
            q.running,
            self.decode.ratio.value,
            # Mixed: the running decodes' tokens ride in this batch and count against it.
            budget - (len(q.running) if self.mixed_chunk else 0),
            self.chunk_size,
            max_new_reqs,
            self.kv.page_size,
        )
        if q.chunked is not None:
            adder.add_chunked_req(q.chunked)
        for req in q.waiting:
            if req.rid in self.policy.held_back and (adder.can_run_list or q.running):
                continue
            if adder.add_one_req(req) != AddResult.CONTINUE:
                break
        return adder

    def prefill_budget(self) -> int:
        """This round's prefill-token budget, from the new tokens waiting after the policy
        matched them: a request held back for a prefix shared with one ahead of it counts
        next round, when that prefix is cached."""
        low, high = self.budget_range
        if low == high:
            return low
        q, held_back = self.queues, self.policy.held_back
        queued = sum(r.extend_input_len() for r in q.waiting if r.rid not in held_back)
        if q.chunked is not None:
            queued += q.chunked.seq_len() - q.chunked.kv.prefix_len()
        return self.server_args.prefill_token_budget(queued)
