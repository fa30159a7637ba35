"""Token embedding and the LM head (optionally sharing the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.cpu_packed import PackableLinear
from srt.layers.weight_utils import default_weight_loader, set_weight_loader


class VocabEmbedding(nn.Module):
    """input_ids [T] -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(PackableLinear):
    """The output projection [vocab, hidden]: `forward(hidden)` -> logits in the model dtype.
    `LogitsProcessor` picks the rows and applies it."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None
        self.tied = False
        set_weight_loader(self.weight, default_weight_loader)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding matrix (`tie_word_embeddings`)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("cannot tie an LM head to an embedding of a different shape")
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden_states)

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
