"""`DraftController`: how many tokens each running request drafts this step, so that
speculation never makes decoding slower than not speculating.

A draft costs a row of the verify forward whether or not it is accepted; it pays only when
accepted. So:
- Per request, a moving average of accepted / drafted tokens scales the draft length; when it
  falls below `min_accept_rate` the request stops drafting for a while (a cooldown that
  doubles each time it recurs, up to `MAX_COOLDOWN` steps) and then tries again. Random
  text drafts little (the proposers find no match) and stops soon after its first misses.
- Per batch, past `max_batch_size` running requests nothing drafts: a forward over that many
  rows is bound by arithmetic, not by reading the weights, and extra rows cost their full
  share. At most `max_batch_tokens` draft tokens go into one verify forward, shared in the
  running order.
- A draft never goes past what the request may still produce (`max_new_tokens`, the
  context length), nor past the KV slots the scheduler can spare (`spare_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from srt.speculative.proposers import DraftProposer, DraftState
from srt.speculative.verify import grammar_prefix

MAX_COOLDOWN = 64
FIRST_COOLDOWN = 4
RATE_MEMORY = 0.5  # weight of the past in the acceptance average


class DraftController:
    def __init__(
        self,
        proposer: DraftProposer,
        num_draft_tokens: int,
        max_batch_size: int,
        max_batch_tokens: int,
        min_accept_rate: float,
        context_len: int,
    ) -> None:
        self.proposer = proposer
        self.k = num_draft_tokens
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.min_accept_rate = min_accept_rate
        self.context_len = context_len

    def drafts(self, reqs: Sequence[Any], spare_tokens: int) -> list[list[int]] | None:
        """Each request's draft (possibly empty), or None when no request drafts."""
        if not self.k or len(reqs) > self.max_batch_size:
            return None
        budget = min(spare_tokens, self.max_batch_tokens)
        out: list[list[int]] = []
        for req in reqs:
            state = req.spec
            if state is None:
                state = req.spec = DraftState()
            k = min(budget, self._room(req, state))
            draft: list[int] = []
            if k > 0:
                draft = self.proposer.propose(state, req.all_ids(), k)
                if draft and req.grammar is not None:
                    draft = grammar_prefix(req.grammar, draft)
            state.last_draft = draft
            budget -= len(draft)
            out.append(draft)
        return out if any(out) else None

    def _room(self, req: Any, state: DraftState) -> int:
        """The most tokens the request may draft now (0 during its cooldown)."""
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        if req.grammar is not None and not req.grammar.can_rollback:
            return 0
        p = req.sampling_params
        room = self.context_len - 1 - req.seq_len()
        if p.max_new_tokens is not None:
            room = min(room, p.max_new_tokens - len(req.output_ids) - 1)
        scaled = max(1, round(self.k * state.accept_rate))
        return max(0, min(room, scaled))

    def observe(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of the request's `drafted` tokens."""
        state.verify_steps += 1
        if not drafted:
            return
        state.drafted += drafted
        state.accepted += accepted
        rate = RATE_MEMORY * state.accept_rate + (1 - RATE_MEMORY) * accepted / drafted
        if rate < self.min_accept_rate:
            state.backoff = min(max(2 * state.backoff, FIRST_COOLDOWN), MAX_COOLDOWN)
            state.cooldown = state.backoff
            rate = 2 * self.min_accept_rate  # the retry drafts a little, not the full length
        elif accepted == drafted:
            state.backoff = 0
        state.accept_rate = min(rate, 1.0)
