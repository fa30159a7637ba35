"""Speculative decoding without a draft model (`--speculative-algorithm ngram|suffix`).

A decode step of the running requests becomes a verify step when some of them have a draft:

    DecodePlanner.build ── DraftController.drafts (proposers.py: ngram / suffix automaton;
        │                   cut to what a request's grammar accepts)
        ├─ KVManager.allocate_verify: 1 + len(draft) slots per request
        ├─ ScheduleBatch.verify (TARGET_VERIFY) → a decode step of one row per new token
        │   (each reads the request's KV up to its own position), each row sampled as
        │   decoding would (verify.py: DraftRow, DraftVocabMask)
        └─ Output.process_verify: keep samples up to the first rejected draft, append them
            with their stop checks, KVManager.trim the rest, DraftController.observe

Requests without a draft ride along as one-token rows; a step where none drafts is a plain
decode step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.server_args import ServerArgs
    from srt.speculative.controller import DraftController


def create_draft_controller(server_args: ServerArgs, context_len: int) -> DraftController | None:
    """The controller `--speculative-algorithm` asks for, or None when it is off."""
    if server_args.speculative_algorithm is None:
        return None
    from srt.speculative.controller import DraftController
    from srt.speculative.proposers import PROPOSERS

    proposer = PROPOSERS.create(
        server_args.speculative_algorithm,
        server_args.speculative_ngram_min_match_window_size,
        server_args.speculative_ngram_max_match_window_size,
    )
    return DraftController(
        proposer,
        server_args.speculative_num_draft_tokens,
        server_args.speculative_max_batch_size,
        server_args.speculative_max_batch_tokens,
        server_args.speculative_min_accept_rate,
        context_len,
        time_steps=server_args.tp_size == 1,
    )
