"""Token embedding and the LM head (optionally sharing the embedding's weight).

Under tensor parallelism both hold this rank's vocabulary rows (`vocab_layout`: rows
[start, end), zero-padded to the same `rows` on every rank), so a tied LM head still shares
the embedding's parameter. The embedding looks up the ids it holds, zeros the others and
all-reduces: exactly one rank contributes each row, so the sum is exact. The LM head returns
this rank's logit columns; `LogitsProcessor` gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import TPGroup, VocabLayout, vocab_layout
from srt.layers.cpu_packed import PackedWeight, apply_linear
from srt.layers.quantization import QuantizedWeight, record_blocks
from srt.layers.weight_utils import default_weight_loader, set_tp_take, set_weight_loader


def _shard_vocab(
    param: nn.Parameter, vocab_size: int, layout: VocabLayout, owner: nn.Module
) -> None:
    """Record the cut of a vocabulary-sharded parameter: full rows [start, end), zero-padded
    to `layout.rows` (dim 0). The loaders write the padding too, so it is always zero; the
    loader keeps a GGUF-backed weight's blocks on `owner` (`quantization.record_blocks`)."""
    start, end, rows = layout.start, layout.end, layout.rows

    def take(full: torch.Tensor) -> torch.Tensor:
        part = full.narrow(0, start, end - start)
        if end - start == rows:
            return part
        return torch.cat([part, part.new_zeros((rows - (end - start), *part.shape[1:]))])

    set_tp_take(param, (vocab_size, *param.shape[1:]), take)

    def load(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)
        if param.dim() == 2:
            record_blocks(owner, None, 0, loaded_weight, lambda b: b.map_rows(take))

    set_weight_loader(param, load)


class VocabEmbedding(nn.Module):
    """input_ids [T] -> [T, embedding_dim]. Tied to an LM head kept quantized, the table is
    the head's (`quant`, rows dequantized as they are looked up)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.layout = vocab_layout(num_embeddings, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(self.layout.rows, embedding_dim))
        self.quant: QuantizedWeight | None = None
        _shard_vocab(self.weight, num_embeddings, self.layout, self)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return self.quant.rows(ids).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.layout.start
        elsewhere = (local_ids < 0) | (local_ids >= self.layout.end - self.layout.start)
        out = self._lookup(local_ids.masked_fill(elsewhere, 0))
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        shard = ""
        if self.tp.size > 1:
            shard = f", rows [{self.layout.start}, {self.layout.end}) of {self.layout.rows}"
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}"


# Logits of at most this many rows (a decode batch's requests, an extend batch's last tokens)
# run `LMHead.argmax_logits` through the screen; at more rows the float32 LM head is no longer
# bound by reading its weight, and the screen stops paying for itself (`python -m
# bench.bench_one_batch --dtype float32 --batch-size 1 8 16 32 64` measures the crossover).
SCREEN_ROWS = 16
# Past this many candidate columns in a row the screen gives up and the full head runs.
SCREEN_MAX_CANDIDATES = 1024


class LMHead(nn.Module):
    """The output projection [vocab, hidden] (this rank's vocabulary rows): `forward(hidden)`
    -> logits in the model dtype. `LogitsProcessor` picks the rows and applies it.

    A float32 head on a CPU with the bfloat16 panel kernels (AVX512_BF16) also keeps a
    bfloat16 copy of its weight and the weight's row norms (`pack_for_cpu`): when the logits
    feed only an argmax, `argmax_logits` reads that copy (half the bytes) and recomputes in
    float32 only the columns that can still be a row's maximum (the bound and the proof:
    `greedy_screen_logits` in srt/kernels/csrc/packed_linear.c). Greedy ids are those of the
    float32 head, bit for bit; the cost is the copy (half the float32 head's bytes)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.packed: PackedWeight | None = None  # the CPU matmuls' copies (`pack_for_cpu`)
        self.quant: QuantizedWeight | None = None  # or the weight kept quantized
        # The screen's bf16 panels of the weight and the weight's row norms, or None.
        self.screen: tuple[torch.Tensor, torch.Tensor] | None = None
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.layout = vocab_layout(vocab_size, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(self.layout.rows, hidden_size))
        self.bias = nn.Parameter(torch.zeros(self.layout.rows)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                _shard_vocab(param, vocab_size, self.layout, self)
        self.tied = False

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding matrix (`tie_word_embeddings`)."""
        if embedding.weight.shape != self.weight.shape or embedding.layout != self.layout:
            raise ValueError("cannot tie an LM head to an embedding of a different shape")
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden_states)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x)
        return apply_linear(x, self.weight, self.bias, self.packed)

    def pack_for_cpu(self) -> bool:
        """Pack the weight for the CPU matmuls (and the greedy screen's copy, where it can
        run); False where it cannot be packed (or is kept quantized)."""
        if self.quant is not None:
            return False
        self.packed = PackedWeight.pack(self.weight)
        if self.packed is None:
            return False
        kernel = self.packed.kernel
        if (
            kernel is not None
            and kernel.screens_greedy
            and self.weight.dtype == torch.float32
            and self.bias is None
            and self.tp.size == 1
            and self.weight.shape[1] % 2 == 0  # the bf16 panels hold pairs of k
        ):
            weight = self.weight.detach()
            self.screen = (kernel.pack(weight.bfloat16()), weight.double().norm(dim=1).float())
        return True

    def argmax_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits whose every row has its maximum where `forward` has it (the same value, at
        the same columns); elsewhere they may be estimates. For greedy sampling only."""
        kernel = None if self.packed is None else self.packed.kernel
        if (
            kernel is not None
            and self.screen is not None
            and hidden_states.dtype == torch.float32
            and hidden_states.dim() == 2
            and 0 < hidden_states.shape[0] <= SCREEN_ROWS
        ):
            panels, norms = self.screen
            logits = kernel.greedy_logits(
                hidden_states, panels, self.weight.detach(), norms, SCREEN_MAX_CANDIDATES
            )
            if logits is not None:
                return logits
        return self(hidden_states)

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
