"""Test doubles of a draft proposer: drafts taken from known outputs, so that every verify
path (all of a draft accepted, part of it, none) runs whatever a random model's text is."""

from __future__ import annotations

from srt.speculative.proposers import DraftProposer, DraftState


class OracleProposer(DraftProposer):
    """A test double: drafts the continuation of a known sequence, every third token wrong."""

    name = "oracle"

    def __init__(self, known: list[list[int]], vocab: int = 512) -> None:
        super().__init__(1, 1)
        self.known = known
        self.vocab = vocab

    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        for seq in self.known:
            if seq[: len(tokens)] == tokens:
                draft = seq[len(tokens) : len(tokens) + k]
                return [
                    t if (len(tokens) + j) % 3 else (t + 1) % self.vocab
                    for j, t in enumerate(draft)
                ]
        return []
