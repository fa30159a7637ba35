"""Draft proposers, the acceptance rule and the draft controller, without a model."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from srt.speculative.controller import EXPLORE_STEPS, DraftController, StepCost
from srt.speculative.proposers import (
    DraftState,
    NgramProposer,
    RecentOutputs,
    SuffixProposer,
)
from srt.speculative.suffix_automaton import SuffixAutomaton
from srt.speculative.verify import accepted_length, draft_rows, grammar_prefix


def occurrences(text: list[int], pattern: list[int]) -> list[int]:
    """End positions of `pattern` in `text` (brute force)."""
    n = len(pattern)
    return [i + n - 1 for i in range(len(text) - n + 1) if text[i : i + n] == pattern]


@pytest.mark.parametrize("alphabet", [2, 3, 8])
def test_the_automaton_finds_the_longest_repeated_suffix(alphabet: int) -> None:
    rng = random.Random(alphabet)
    text: list[int] = []
    sam = SuffixAutomaton()
    for _ in range(300):
        t = rng.randrange(alphabet)
        text.append(t)
        sam.append(t)
        length, end = sam.repeated_suffix()
        # Brute force: the longest suffix that also ends before the last position.
        best = 0
        for n in range(1, len(text)):
            if any(e < len(text) - 1 for e in occurrences(text, text[-n:])):
                best = n
            else:
                break
        assert length == best
        if best:
            assert end == occurrences(text, text[-best:])[0]


def test_the_automaton_matches_another_sequence_against_its_text() -> None:
    rng = random.Random(1)
    text = [rng.randrange(4) for _ in range(200)]
    sam = SuffixAutomaton(text)
    for _ in range(100):
        tail = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        length, end = sam.longest_match(tail)
        best = max((n for n in range(1, len(tail) + 1) if occurrences(text, tail[-n:])), default=0)
        assert length == best
        if best:
            assert end in occurrences(text, tail[-best:])


def test_ngram_drafts_what_followed_the_most_recent_occurrence() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    state = DraftState()
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6]
    # "5 6" last occurred at positions 6-7, followed by 7 2 3; "3 5 6" never occurred before.
    assert proposer.propose(state, tokens, 3) == [7, 2, 3]
    tokens += [7, 2]  # the index grows with the history, from where it stopped
    assert proposer.propose(state, tokens, 2) == [3, 5]
    assert state.seen == len(tokens)
    assert proposer.propose(DraftState(), [1, 2, 3, 4], 4) == []  # nothing repeats


def test_ngram_prefers_the_longest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    # "2 3" is followed by 9 at its latest occurrence but "1 2 3" by 4.
    tokens = [1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3]
    assert proposer.propose(DraftState(), tokens, 1) == [4]


def test_suffix_drafts_from_its_own_text_and_from_recent_outputs() -> None:
    recent = RecentOutputs()
    proposer = SuffixProposer(min_n=2, max_n=8, recent=recent)
    assert proposer.propose(DraftState(), [1, 2, 3, 4, 1, 2], 2) == [3, 4]
    proposer.on_finished([7, 8, 9, 10, 11])
    # Its own repeated suffix (8 9) wins a tie with the finished output's.
    assert proposer.propose(DraftState(), [8, 9, 50, 8, 9], 3) == [50, 8, 9]
    # The finished output's match (7 8 9) is longer; its draft stops where that output ended.
    assert proposer.propose(DraftState(), [60, 7, 8, 9], 3) == [10, 11]


def test_recent_outputs_stay_bounded() -> None:
    recent = RecentOutputs(max_tokens=100)
    for i in range(50):
        recent.add([1000 + i] * 10)
    assert recent.tokens <= 100
    assert recent.match([1049, 1049], 2) == (2, [1049, 1049])
    assert recent.match([1000, 1000], 2) == (0, [])  # dropped with the older half


def test_acceptance_is_the_leading_run_of_matches() -> None:
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_length([], [3]) == 0


def test_each_draft_row_counts_the_drafts_before_it_as_output() -> None:
    req = SimpleNamespace(
        sampling_params=None, origin_input_ids=[1, 2], output_ids=[3], sampling_seed=7
    )
    rows = draft_rows([req], [[4, 5]])
    assert [r.output_ids for r in rows] == [[3], [3, 4], [3, 4, 5]]
    assert all(r.sampling_seed == 7 for r in rows)


class SequenceGrammar:
    """A test double of a grammar matcher: accepts exactly `allowed`, in order, and is
    complete after the last one."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed, self.pos = allowed, 0

    def accept_token(self, token: int) -> bool:
        if self.pos < len(self.allowed) and self.allowed[self.pos] == token:
            self.pos += 1
            return True
        return False

    def is_terminated(self) -> bool:
        return self.pos == len(self.allowed)

    def rollback(self, n: int) -> None:
        self.pos -= n


def test_a_grammar_cuts_the_draft_and_is_left_where_it_was() -> None:
    grammar = SequenceGrammar([1, 2, 3, 4])
    assert grammar_prefix(grammar, [1, 2, 9, 4]) == [1, 2]
    assert grammar.pos == 0
    # The token that completes the grammar is left to the sampler.
    assert grammar_prefix(grammar, [1, 2, 3, 4]) == [1, 2, 3]
    assert grammar.pos == 0


def fake_req(tokens: list[int], max_new: int = 100, grammar=None) -> SimpleNamespace:
    return SimpleNamespace(
        spec=None,
        grammar=grammar,
        output_ids=[],
        all_ids=lambda: tokens,
        seq_len=lambda: len(tokens),
        sampling_params=SimpleNamespace(max_new_tokens=max_new),
    )


def controller(**overrides) -> DraftController:
    args = {
        "num_draft_tokens": 4,
        "max_batch_size": 4,
        "max_batch_tokens": 64,
        "min_accept_rate": 0.25,
        "context_len": 1000,
    }
    return DraftController(NgramProposer(1, 4), **{**args, **overrides})


REPEATING = [1, 2, 3, 4, 5, 6] * 3


def test_the_controller_bounds_drafts_by_room_budget_and_batch() -> None:
    c = controller()
    assert c.drafts([fake_req(REPEATING)], spare_tokens=100) == [[1, 2, 3, 4]]
    assert c.drafts([fake_req(REPEATING, max_new=3)], spare_tokens=100) == [[1, 2]]
    assert c.drafts([fake_req(REPEATING), fake_req(REPEATING)], spare_tokens=5) == [
        [1, 2, 3, 4],
        [1],
    ]
    assert c.drafts([fake_req(REPEATING)], spare_tokens=0) is None
    assert c.drafts([fake_req(REPEATING)] * 5, spare_tokens=100) is None  # batch too large
    assert c.drafts([fake_req([1, 2, 3])], spare_tokens=100) is None  # nothing to draft


def fail_until_paused(c: DraftController, req: SimpleNamespace) -> int:
    """Draft and reject everything until the request pauses; return the drafted tokens."""
    drafted = 0
    for _ in range(10):
        [draft] = c.drafts([req], 100)
        drafted += len(draft)
        c.observe(req.spec, len(draft), 0)
        if req.spec.cooldown:
            return drafted
    raise AssertionError("never paused")


def test_the_controller_pauses_a_request_whose_drafts_fail() -> None:
    c = controller()
    req = fake_req(REPEATING)
    drafted = fail_until_paused(c, req)
    assert req.spec.cooldown == req.spec.backoff == 4
    for _ in range(req.spec.cooldown):
        assert c.drafts([req], 100) is None
    # The retry drafts less than the full length; failing again doubles the pause.
    [retry] = c.drafts([req], 100)
    assert 0 < len(retry) < 4
    c.observe(req.spec, len(retry), 0)
    drafted += len(retry) + (fail_until_paused(c, req) if not req.spec.cooldown else 0)
    assert req.spec.backoff == 8
    assert req.spec.drafted == drafted and req.spec.accepted == 0


def test_full_acceptance_keeps_the_full_draft_length() -> None:
    c = controller()
    req = fake_req(REPEATING)
    for _ in range(5):
        [draft] = c.drafts([req], 100)
        assert len(draft) == 4
        c.observe(req.spec, 4, 4)


def test_the_step_cost_fit_needs_steps_of_two_sizes() -> None:
    cost = StepCost()
    for _ in range(5):
        cost.add(1, 0.006)
    assert cost.fit() is None
    for _ in range(5):
        cost.add(5, 0.011)
    a, b = cost.fit()
    assert a == pytest.approx(0.00475) and b == pytest.approx(0.00125)


def timed(c: DraftController, a: float, b: float) -> DraftController:
    for rows in (1, 9) * 4:
        c.timed(rows, a + b * rows)
    return c


def requests(n: int, accept_rate: float) -> list[SimpleNamespace]:
    reqs = [fake_req(REPEATING) for _ in range(n)]
    for r in reqs:
        r.spec = DraftState(accept_rate=accept_rate)
    return reqs


def test_drafts_are_kept_only_while_they_raise_tokens_per_second() -> None:
    # Rows are cheap next to the step (a forward bound by reading weights): every draft.
    cheap = timed(controller(max_batch_size=32), a=0.020, b=0.0005)
    assert [len(d) for d in cheap.drafts(requests(16, 0.9), 1000)] == [4] * 16
    # Each row costs nearly a step of its own: drafts accepted half the time do not pay.
    dear = timed(controller(max_batch_size=32), a=0.002, b=0.002)
    assert dear.drafts(requests(16, 0.5), 1000) is None
    # In between, the likeliest tokens first: each request's first draft token.
    mid = timed(controller(max_batch_size=32), a=0.006, b=0.0012)
    assert [len(d) for d in mid.drafts(requests(16, 0.9), 1000)] == [1] * 16


def test_when_drafts_stopped_one_short_draft_is_tried_now_and_then() -> None:
    c = timed(controller(max_batch_size=32), a=0.002, b=0.002)
    reqs = requests(4, 0.5)
    tries = [c.drafts(reqs, 1000) for _ in range(EXPLORE_STEPS + 1)]
    assert all(t is None for t in tries[:-1])
    assert tries[-1] == [[1]] * 4
