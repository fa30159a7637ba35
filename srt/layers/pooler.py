"""Hidden states -> one embedding per request (`--is-embedding`; the method is read by
`srt/configs/pooling.py`).

A prompt may run in several chunks (chunked prefill), so a forward returns each request's
*part* and the scheduler combines the parts (`add_part`) until the prompt is done
(`finish_vector`):

- `last`: the last new token's state; the final chunk's part is the answer. Only the last
  row is computed past the last layer's attention, and a cached prefix is reused.
- `cls`: the first token's state, from the chunk that starts at position 0 (such prompts
  never start from a cached prefix).
- `mean`: the sum of the new tokens' states; divided by the prompt length at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from srt.layers.logits_processor import last_token_indices

if TYPE_CHECKING:
    from srt.model_executor.forward_batch import ForwardBatch


def pooled_rows(method: str, forward_batch: ForwardBatch) -> torch.Tensor | None:
    """The rows of the batch's new tokens that a method reads (None: all of them)."""
    if method == "last":
        return last_token_indices(forward_batch)
    if method == "cls":
        assert forward_batch.extend_seq_lens is not None
        return last_token_indices(forward_batch) - forward_batch.extend_seq_lens + 1
    return None


def pool_parts(method: str, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """Each request's part, float32 [N, hidden], from the rows `pooled_rows` kept."""
    if method != "mean":
        return hidden.float()
    lens = forward_batch.extend_seq_lens
    assert lens is not None
    owner = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
    sums = torch.zeros(len(lens), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, owner, hidden.float())


def add_part(
    method: str, acc: torch.Tensor | None, part: torch.Tensor, prefix_len: int
) -> torch.Tensor | None:
    """The running state after one more chunk that started at `prefix_len`."""
    if method == "mean":
        return part if acc is None else acc + part
    if method == "cls":
        return part if prefix_len == 0 else acc
    return part


def finish_vector(
    method: str, acc: torch.Tensor, num_tokens: int, dimensions: int | None, normalize: bool
) -> list[float]:
    """The embedding: the mean taken, truncated to `dimensions` (Matryoshka), then made unit
    length if the model normalizes (so a truncated vector is unit length too, as OpenAI's)."""
    vector = acc / num_tokens if method == "mean" else acc
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.tolist()
