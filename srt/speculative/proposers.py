"""Draft proposers: guesses at a request's next tokens that cost no model forward.

A proposer reads a request's tokens (prompt + output so far) and returns up to k tokens it
expects the model to produce next; the target model then checks them all in one forward
(`srt/speculative/verify.py`). Each keeps per-request state in a `DraftState` the scheduler
holds on the request (`Req.spec`), updated from the tokens appended since its last call, so a
step costs a few dictionary lookups per request, not a scan of the context.

- `ngram`: the last n tokens (n from `max_n` down to `min_n`) looked up in the request's own
  context; the draft is what followed their most recent earlier occurrence (prompt lookup
  decoding).
- `suffix`: the longest repeated suffix of the request's context (a suffix automaton, no
  bound on n), or, when longer, the longest suffix of it found in the outputs of recently
  finished requests (`RecentOutputs`, shared by all requests): the workloads where outputs
  repeat other outputs (templated answers, JSON of the same shape) draft from those.

Both are deterministic functions of the token history and of the finished requests' order,
so every tensor-parallel rank proposes the same drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from srt.speculative.suffix_automaton import SuffixAutomaton
from srt.utils.registry import Registry


@dataclass(slots=True)
class DraftState:
    """A request's speculation state: the proposer's index over its tokens, and what the
    controller (`controller.py`) learned of its drafts."""

    index: Any = None  # the proposer's per-request structure
    seen: int = 0  # tokens of the request the index holds
    accept_rate: float = 1.0  # moving average of accepted / drafted tokens
    cooldown: int = 0  # decode steps left without drafting
    backoff: int = 0  # the next cooldown's length
    drafted: int = 0  # the request's totals over its verify steps
    accepted: int = 0


class DraftProposer(ABC):
    name = ""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = max(1, min_n)
        self.max_n = max(self.min_n, max_n)

    @abstractmethod
    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the request's whole history, which only grows
        between calls: `state.seen` of them are indexed already)."""

    def on_finished(self, output_ids: list[int]) -> None:
        """A request finished with these output tokens (a proposer may learn from them)."""


class NgramProposer(DraftProposer):
    """Prompt lookup: per n, a dict from each n-gram to the position after its most recent
    occurrence that has a token after it."""

    name = "ngram"

    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        if state.index is None:
            state.index = {n: {} for n in range(self.min_n, self.max_n + 1)}
        index: dict[int, dict[tuple[int, ...], int]] = state.index
        # Register every n-gram that now has a continuation: those ending before the last
        # token, from where the previous call stopped.
        end = len(tokens) - 1
        for p in range(max(state.seen, 1), end + 1):
            for n, table in index.items():
                if p >= n:
                    table[tuple(tokens[p - n : p])] = p
        state.seen = len(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            start = index[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []


class RecentOutputs:
    """The outputs of the last finished requests, one suffix automaton over all of them, each
    output ended by its own separator (a negative id, so no match runs across two). Rebuilt
    from the newer half when it holds more than `max_tokens`."""

    def __init__(self, max_tokens: int = 65536) -> None:
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.automaton = SuffixAutomaton()
        self._separator = 0

    def add(self, output: list[int]) -> None:
        if not output:
            return
        self.outputs.append(list(output))
        self.tokens += len(output)
        if self.tokens > self.max_tokens:
            while self.outputs and self.tokens > self.max_tokens // 2:
                self.tokens -= len(self.outputs.popleft())
            self.automaton = SuffixAutomaton()
            for kept in self.outputs:
                self._append(kept)
        else:
            self._append(output)

    def _append(self, output: list[int]) -> None:
        self._separator -= 1
        self.automaton.extend(output)
        self.automaton.append(self._separator)

    def match(self, tail: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, draft) for the longest suffix of `tail` found in the outputs."""
        length, end = self.automaton.longest_match(tail)
        if length == 0:
            return 0, []
        draft = self.automaton.continuation(end, k)
        for i, t in enumerate(draft):
            if t < 0:  # a separator: the output ended there
                return length, draft[:i]
        return length, draft


class SuffixProposer(DraftProposer):
    name = "suffix"
    # How much of a request's tail is matched against the recent outputs.
    TAIL = 64

    def __init__(self, min_n: int, max_n: int, recent: RecentOutputs | None = None) -> None:
        super().__init__(min_n, max_n)
        self.recent = recent if recent is not None else RecentOutputs()

    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        if state.index is None:
            state.index = SuffixAutomaton()
        own: SuffixAutomaton = state.index
        own.extend(tokens[state.seen :])
        state.seen = len(tokens)
        length, end = own.repeated_suffix()
        draft = own.continuation(end, k) if length >= self.min_n else []
        other_len, other = self.recent.match(tokens[-self.TAIL :], k)
        if other_len >= self.min_n and other_len > length and other:
            return other
        return draft

    def on_finished(self, output_ids: list[int]) -> None:
        self.recent.add(output_ids)


PROPOSERS: Registry[DraftProposer] = Registry("speculative algorithm")
PROPOSERS.register("ngram", NgramProposer)
PROPOSERS.register("suffix", SuffixProposer)
