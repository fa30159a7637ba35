"""`DecodePlanner`: the next decode step of the running requests, retracting when short.

Retraction takes the requests with the fewest output tokens first (among those, the longest
prompt frees the most KV), caches their KV in the tree and sends them back to the waiting
queue; a resumed request recomputes only what the tree no longer holds and produces the same
tokens. A lone request that cannot get one more slot is finished with an error.

`NewTokenRatio` is the share of a running request's remaining `max_new_tokens` that admission
reserves for its growth: it starts high, decays a little every decode step, and is raised
after a retraction to what the running requests actually needed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from managers.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from managers.req import Req
    from managers.scheduler.emitter import Emitter
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager
    from srt.speculative.controller import DraftController

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    def __init__(self, conservativeness: float) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min = min(MIN_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.step = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - self.step, self.min)

    def raise_for(self, running: list[Req]) -> None:
        """After a retraction: at least what the survivors need for the next few steps."""
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.sampling_params.max_new_tokens or 0 for r in running) or 1
        needed = (decoded + RETRACT_DECODE_STEPS * len(running)) / max_new
        self.value = max(self.value, min(1.0, needed))

    def reset(self) -> None:
        self.value = self.init


class DecodePlanner:
    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        emitter: Emitter,
        conservativeness: float,
        drafts: DraftController | None = None,
    ) -> None:
        """`drafts`: speculative decoding's controller (None: decode one token a step)."""
        self.queues = queues
        self.kv = kv
        self.emitter = emitter
        self.ratio = NewTokenRatio(conservativeness)
        self.drafts = drafts
        self.num_retracted_reqs = 0  # cumulative, reported in the server info

    def build(self, decay: bool = True) -> ScheduleBatch | None:
        """The decode batch of every running request, or None when nothing runs. A decode
        step of its own decays the new-token ratio and may verify drafts (TARGET_VERIFY);
        decodes mixed into a prefill do neither."""
        if not self.prepare_running():
            return None
        running = self.queues.running
        drafts = None
        if decay and self.drafts is not None:
            # Draft slots come after every running request's next slot is sure.
            spare = self.kv.available_tokens() - len(running) * self.kv.page_size
            drafts = self.drafts.drafts(running, spare)
        spans = [r.kv for r in running]
        if drafts is not None:
            counts = [len(d) + 1 for d in drafts]
            batch = ScheduleBatch.verify(running, drafts, self.kv.allocate_verify(spans, counts))
        else:
            batch = ScheduleBatch.decode(running, self.kv.allocate_decode(spans))
        if decay:
            self.ratio.decay()
        return batch

    def prepare_running(self) -> bool:
        """Drop finished requests and retract until the next decode step fits; return whether
        any request is left to decode."""
        q = self.queues
        q.running = [r for r in q.running if not r.finished() and not r.is_chunked]
        if not q.running:
            return False
        retracted = self.retract_until_fits()
        if retracted:
            q.waiting.extend(retracted)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                "#new_token_ratio: %.4f",
                len(retracted),
                self.ratio.value,
            )
        return bool(q.running)

    def _fits(self, steps: int) -> bool:
        need = self.kv.decode_tokens_needed(r.kv for r in self.queues.running)
        return self.kv.available_tokens() >= need * steps

    def retract_until_fits(self) -> list[Req]:
        if self._fits(1):
            return []
        running = self.queues.running
        retracted: list[Req] = []
        # Fewest output tokens first; among those, the longest prompt frees the most KV.
        order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        while not self._fits(min(RETRACT_DECODE_STEPS, 1 + len(retracted))) and len(order) > 1:
            req = order.pop(0)
            running.remove(req)
            self.kv.cache_finished(req)
            req.reset_for_retract()
            retracted.append(req)
        if not self._fits(1):
            # A lone request that cannot get one more slot can never finish.
            req = order[0]
            running.remove(req)
            self.kv.cache_finished(req)
            self.emitter.fail(
                req,
                f"The KV cache pool ({self.kv.total_tokens} tokens) is too small for this "
                f"request ({req.seq_len()} tokens so far).",
            )
        self.num_retracted_reqs += len(retracted)
        self.ratio.raise_for(running)
        return retracted
