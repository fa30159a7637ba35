"""How a tensor-parallel rank's share of a model is computed: pure arithmetic, no torch.

Attention heads are split by KV group, so a rank holds whole groups of query heads with the
KV head they read. The split may be uneven: SmolLM2-135M has 9 query heads over 3 KV heads,
and at `--tp-size 2` rank 0 holds KV head 0 (3 query heads), rank 1 KV heads 1-2 (6 query
heads). Nothing else needs even shares: every all-reduce is over `[tokens, hidden]`. With
fewer KV heads than ranks, each KV head is replicated on `size // num_kv_heads` ranks, which
split that head's query heads between them.

The vocabulary is split in contiguous row ranges, each padded to the same `rows` so the
logits can be all-gathered as equal shapes and cut back to `vocab_size`.
"""

from __future__ import annotations

from dataclasses import dataclass


def balanced_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `n` items are split into `parts` near-equal runs."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    return index * n // parts, (index + 1) * n // parts


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """One rank's attention heads: global [start, end) ranges and the local counts."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    replicated_kv: bool  # this rank's KV head is also held by other ranks

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def head_layout(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadLayout:
    """The heads rank `rank` of `size` holds; a ValueError when the model cannot be split."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= size:
        kv = balanced_range(num_kv_heads, size, rank)
        return HeadLayout((kv[0] * group, kv[1] * group), kv, replicated_kv=False)
    if size % num_kv_heads:
        raise ValueError(
            f"--tp-size {size} cannot split {num_kv_heads} KV heads: with fewer KV heads than "
            f"ranks, the ranks must be a multiple of the KV heads"
        )
    replicas = size // num_kv_heads
    if group < replicas:
        raise ValueError(
            f"--tp-size {size} leaves some ranks without an attention head "
            f"({num_heads} heads over {num_kv_heads} KV heads)"
        )
    kv_head = rank // replicas
    q_start, q_end = balanced_range(group, replicas, rank % replicas)
    base = kv_head * group
    return HeadLayout((base + q_start, base + q_end), (kv_head, kv_head + 1), replicated_kv=True)


@dataclass(frozen=True, slots=True)
class VocabLayout:
    """One rank's vocabulary rows: real rows [start, end), held in a shard of `rows` rows
    (rows past `end - start` are zero padding, so every rank's shard has the same shape)."""

    start: int
    end: int
    rows: int


def vocab_layout(vocab_size: int, size: int, rank: int) -> VocabLayout:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for {size} ranks")
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return VocabLayout(start, min(start + rows, vocab_size), rows)
