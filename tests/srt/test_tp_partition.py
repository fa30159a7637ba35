"""The arithmetic of a tensor-parallel rank's share (srt/distributed/partition.py)."""

from __future__ import annotations

import itertools

import pytest

from srt.distributed import balanced_range, head_layout, vocab_layout


def _layouts(h: int, k: int, n: int) -> list:
    return [head_layout(h, k, n, r) for r in range(n)]


def test_balanced_ranges_cover_without_overlap() -> None:
    for n in (0, 1, 5, 9, 1536):
        for parts in (1, 2, 3, 4):
            ranges = [balanced_range(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_default_model_splits_unevenly_by_kv_group() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads
    r0, r1 = _layouts(9, 3, 2)
    assert (r0.kv_heads, r0.q_heads) == ((0, 1), (0, 3))
    assert (r1.kv_heads, r1.q_heads) == ((1, 3), (3, 9))
    assert (r0.num_heads, r1.num_heads, r0.num_kv_heads, r1.num_kv_heads) == (3, 6, 1, 2)
    assert not r0.replicated_kv


def test_even_split_and_mqa() -> None:
    assert [(x.q_heads, x.kv_heads) for x in _layouts(4, 2, 2)] == [
        ((0, 2), (0, 1)),
        ((2, 4), (1, 2)),
    ]
    mqa = _layouts(4, 1, 2)  # one KV head, replicated on both ranks
    assert [(x.q_heads, x.kv_heads, x.replicated_kv) for x in mqa] == [
        ((0, 2), (0, 1), True),
        ((2, 4), (0, 1), True),
    ]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    layouts = _layouts(8, 2, 4)
    assert [x.kv_heads for x in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [x.q_heads for x in layouts] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(x.replicated_kv for x in layouts)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        head_layout(9, 3, 4, 0)
    with pytest.raises(ValueError, match="without an attention head"):
        head_layout(2, 1, 4, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        head_layout(9, 2, 1, 0)


def test_vocab_shards_are_padded_to_one_shape() -> None:
    shards = [vocab_layout(49153, 2, r) for r in range(2)]
    assert [(s.start, s.end, s.rows) for s in shards] == [(0, 24577, 24577), (24577, 49153, 24577)]
    tiny = [vocab_layout(5, 4, r) for r in range(4)]
    assert [(s.start, s.end) for s in tiny] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert {s.rows for s in tiny} == {2}
