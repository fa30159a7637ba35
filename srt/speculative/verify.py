"""Checking drafts against the target model: which rows a verify forward samples, and how
many draft tokens each request keeps.

A request with draft d_1..d_k feeds [t, d_1, ..., d_k] (t: its last token) in one forward; row
j's logits are the model's distribution for the token after d_j (after t for j = 0), exactly
what a decode step would compute once d_1..d_j had been accepted. Each row is sampled as that
decode step would sample it: the same logits processing, with penalties counting d_1..d_j as
output (`DraftRow`), the grammar mask after d_1..d_j (`draft_grammar_masks`), and the seeded
draw of output position n + j. Row j's sample s_j is the token decoding would have produced,
so d_{j+1} is accepted when it equals s_j, and the first row whose draft differs gives the
last token (the "bonus"): the request keeps s_0..s_a where a is the number of leading drafts
accepted. The output is token for token the one decoding would give, greedy or sampled.

For sampling this is the standard rejection rule for a draft that puts all its probability
on one token: the rule accepts d with probability min(1, p(d) / 1) = p(d) and otherwise draws
from p with d removed (renormalised); drawing x ~ p and keeping d only if x == d does both at
once. So the output distribution is the target model's, and with our seeded draws (a function
of seed and output position, `srt/sampling/seeded_noise.py`) even the draws are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
    from srt.sampling.sampling_params import SamplingParams


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading draft tokens equal the samples of the rows before them
    (`sampled` has one more entry than `draft`)."""
    a = 0
    for d, s in zip(draft, sampled, strict=False):
        if d != s:
            break
        a += 1
    return a


class DraftRow:
    """One row of a verify forward as the sampling code sees a request (`ReqLike`): the
    request's parameters and seed, with the first j draft tokens counted as output."""

    __slots__ = ("origin_input_ids", "output_ids", "sampling_params", "sampling_seed")

    def __init__(self, req: Any, draft_prefix: list[int]) -> None:
        self.sampling_params: SamplingParams = req.sampling_params
        self.origin_input_ids: list[int] = req.origin_input_ids
        self.output_ids: list[int] = (
            req.output_ids + draft_prefix if draft_prefix else req.output_ids
        )
        self.sampling_seed: int = req.sampling_seed


def draft_rows(reqs: Sequence[Any], drafts: Sequence[list[int]]) -> list[DraftRow]:
    return [
        DraftRow(req, draft[:j])
        for req, draft in zip(reqs, drafts, strict=True)
        for j in range(len(draft) + 1)
    ]


def grammar_prefix(grammar: BaseGrammarObject, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar accepts from its current state, short of
    the token that would complete it (the matcher is left where it was)."""
    accepted = 0
    terminated = False
    for token in draft:
        if not grammar.accept_token(token):
            break
        accepted += 1
        terminated = grammar.is_terminated()
        if terminated:
            break
    if accepted:
        grammar.rollback(accepted)
    # A token that completes the grammar ends the request: it is left to the sampler, so
    # that no row is sampled from a finished matcher's empty mask.
    return draft[: accepted - terminated]


class DraftVocabMask:
    """A verify batch's grammar bitmask: row j of a constrained request holds the tokens its
    grammar allows after d_1..d_j (drafts were cut to what the grammar accepts)."""

    def __init__(
        self,
        backend: BaseGrammarBackend,
        grammars: Sequence[BaseGrammarObject | None],
        drafts: Sequence[list[int]],
    ) -> None:
        self.backend = backend
        self.rows: list[int] = []
        self.mask = backend.allocate_mask(sum(len(d) + 1 for d in drafts))
        row = 0
        for grammar, draft in zip(grammars, drafts, strict=True):
            if grammar is None:
                row += len(draft) + 1
                continue
            for j in range(len(draft) + 1):
                grammar.fill_vocab_mask(self.mask, row)
                self.rows.append(row)
                row += 1
                if j < len(draft):
                    ok = grammar.accept_token(draft[j])
                    assert ok, "drafts are cut to what the grammar accepts"
            if draft:
                grammar.rollback(len(draft))

    def apply(self, logits: torch.Tensor) -> None:
        self.backend.apply_mask(logits, self.mask.to(logits.device), self.rows)
