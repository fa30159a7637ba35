"""`DraftController`: how many tokens each running request drafts this step, so that
speculation never makes decoding slower than not speculating.

A draft costs a row of the verify forward whether or not it is accepted; it pays only when
accepted. So:
- Per request, a moving average of accepted / drafted tokens scales the draft length; when it
  falls below `min_accept_rate` the request stops drafting for a while (a cooldown that
  doubles each time it recurs, up to `MAX_COOLDOWN` steps) and then tries again. Random
  text drafts little (the proposers find no match) and stops soon after its first misses.
- Per batch, draft tokens are kept only while they raise the expected tokens per second of
  the step (`StepCost`): a step of r rows takes about a + b r seconds, fitted online to the
  decode and verify steps' own times (building the batch, the forward, processing the result:
  drafting, each row's sampling and the acceptance bookkeeping cost too), and the j-th draft
  token of a request that accepts a share p of its drafts is worth p^j tokens. Keeping tokens
  in order of worth while worth > b x (tokens / seconds so far) maximises the ratio. Where
  rows are cheap (a forward bound by reading the weights) every good draft goes in; where each
  row costs its full share (many requests, or a CPU whose arithmetic is the limit) few or none
  do. Until both kinds of step have been timed every draft goes in, and when drafts stopped,
  one short draft per request is tried every `EXPLORE_STEPS` steps, so the fit follows the
  machine.
  Under tensor parallelism the fit is off (each rank would time its own steps, and every
  rank must draft the same tokens); the acceptance rule and the limits below still hold.
- Past `max_batch_size` running requests nothing drafts; at most `max_batch_tokens` draft
  tokens go into one verify forward.
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
EXPLORE_STEPS = 100
COST_MEMORY = 0.995  # per timed step: the fit follows load and machine over ~200 steps
MIN_ROW_SPREAD = 0.5  # variance of the timed row counts below which no slope is fitted


class StepCost:
    """Seconds of a decode or verify step of r rows, t(r) = a + b r: least squares over the
    timed steps, older steps weighing less."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        m = COST_MEMORY
        self.w = m * self.w + 1.0
        self.x = m * self.x + rows
        self.y = m * self.y + seconds
        self.xx = m * self.xx + rows * rows
        self.xy = m * self.xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different sizes were timed."""
        if self.w < 2.0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < MIN_ROW_SPREAD:
            return None
        b = max((self.xy / self.w - mx * my) / var, 0.0)
        return max(my - b * mx, 1e-6), b


class DraftController:
    def __init__(
        self,
        proposer: DraftProposer,
        num_draft_tokens: int,
        max_batch_size: int,
        max_batch_tokens: int,
        min_accept_rate: float,
        context_len: int,
        time_steps: bool = True,
    ) -> None:
        """`time_steps`: fit the step cost from this process's own timings. Off under
        tensor parallelism: every rank must draft alike, and each would time its own."""
        self.proposer = proposer
        self.k = num_draft_tokens
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.min_accept_rate = min_accept_rate
        self.context_len = context_len
        self.cost = StepCost()
        self.time_steps = time_steps
        self._since_draft = 0  # steps since the last verify step

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
            budget -= len(draft)
            out.append(draft)
        out = self._worth_it(reqs, out)
        self._since_draft = 0 if any(out) else self._since_draft + 1
        return out if any(out) else None

    def _worth_it(self, reqs: Sequence[Any], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts cut to the tokens that raise the step's expected tokens per second
        (module doc); one token each when exploring."""
        fit = self.cost.fit()
        if fit is None or not any(drafts):
            return drafts
        a, b = fit
        worth = []
        for i, (req, draft) in enumerate(zip(reqs, drafts, strict=True)):
            p = min(max(req.spec.accept_rate, 0.05), 0.98)
            worth += [(p ** (j + 1), i) for j in range(len(draft))]
        worth.sort(reverse=True)
        tokens, seconds = float(len(reqs)), a + b * len(reqs)
        keep = [0] * len(drafts)
        for value, i in worth:
            if value <= b * tokens / seconds:
                break
            tokens, seconds = tokens + value, seconds + b
            keep[i] += 1
        if not any(keep) and self._since_draft >= EXPLORE_STEPS:
            keep = [1] * len(drafts)
        return [d[:n] for d, n in zip(drafts, keep, strict=True)]

    def timed(self, rows: int, seconds: float) -> None:
        """A decode or verify step of `rows` rows took `seconds`, built to processed."""
        if self.time_steps:
            self.cost.add(rows, seconds)

    def _room(self, req: Any, state: DraftState) -> int:
        """The most tokens the request may draft now (0 during its cooldown)."""
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        p = req.sampling_params
        room = self.context_len - 1 - req.seq_len()
        if p.max_new_tokens is not None:
            room = min(room, p.max_new_tokens - len(req.output_ids) - 1)
        scaled = max(1, round(self.k * state.accept_rate))
        return max(0, min(room, scaled))

    def observe(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of the request's `drafted` tokens."""
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
