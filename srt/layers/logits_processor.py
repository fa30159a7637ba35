"""Final hidden states -> float32 logits, only at the rows that need them.

Under tensor parallelism each rank's LM head yields its vocabulary shard's columns; they are
all-gathered here, once, so sampling, grammar masks, penalties and logprobs see the full
vocabulary on every rank exactly as at tp=1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from srt.distributed import TPGroup

if TYPE_CHECKING:
    from srt.layers.vocab_embedding import LMHead
    from srt.model_executor.forward_batch import ForwardBatch


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    """Index of each request's last new token among the batch's T new tokens."""
    extend_seq_lens = forward_batch.extend_seq_lens
    assert extend_seq_lens is not None, "extend batches need extend_seq_lens"
    return torch.cumsum(extend_seq_lens, dim=0) - 1


def logits_rows(forward_batch: ForwardBatch) -> torch.Tensor | None:
    """The rows of the batch's T new tokens that get logits, in order; None means all of them
    (a decode batch without `logits_indices`). The one rule for the processor and for the
    model, whose last layer computes only these rows past the attention."""
    if forward_batch.logits_indices is not None:
        return forward_batch.logits_indices
    if forward_batch.forward_mode.is_decode():
        return None
    return last_token_indices(forward_batch)


class LogitsProcessor(nn.Module):
    """hidden [T, hidden] -> float32 logits [N, vocab], computed only at the N selected rows.

    Rows: `logits_rows` (`forward_batch.logits_indices` when set; otherwise every row for
    decode and the last new token of each request for extend / mixed). With `rows_selected`
    the hidden states are those rows already (the model's last layer kept only them). With
    `forward_batch.argmax_only` the logits are only fit for an argmax (`LMHead.argmax_logits`).
    """

    def __init__(self, vocab_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp or TPGroup.single()

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: LMHead,
        forward_batch: ForwardBatch,
        rows_selected: bool = False,
    ) -> torch.Tensor:
        indices = None if rows_selected else logits_rows(forward_batch)
        if indices is not None:
            hidden_states = hidden_states.index_select(0, indices)
        if forward_batch.argmax_only and self.tp.size == 1:
            return lm_head.argmax_logits(hidden_states).float()
        logits = lm_head(hidden_states).float()
        if self.tp.size == 1:
            return logits
        # Shards are padded to equal widths; the padding columns sit past vocab_size.
        logits = self.tp.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size].contiguous()
