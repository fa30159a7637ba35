"""Sharded layers on two gloo ranks against their tp=1 twins (whole models: test_tp_models.py).

Every rank builds the same full weights from one seeded generator, loads them into a tp=1
layer and into its tensor-parallel shard, and compares: a column-parallel layer's output
must be its slice of the tp=1 output, a row-parallel layer's (and the vocabulary-parallel
embedding's and logits') the whole tp=1 output. Head splits cover the uneven 9/3 heads of
SmolLM2 and a KV head replicated over both ranks (4 q heads over 1 KV head). The functions
that run on the ranks are top-level so the harness can send them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed import TPGroup, balanced_range, head_layout, vocab_layout
from srt.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.vocab_embedding import LMHead, VocabEmbedding
from srt.layers.weight_utils import get_weight_loader
from tests.distributed.tp_harness import TPRanks

HIDDEN, HEAD_DIM, INTER = 16, 4, 11  # INTER is odd: the ranks hold 5 and 6 of its rows


def _load(layer: nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    param = getattr(layer, name)
    loader = get_weight_loader(param)
    if shard is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard)


def _pack(prepack: bool, *layers: Any) -> None:
    if prepack:
        assert all(layer.pack_for_cpu() for layer in layers)


def _merged_column(tp: TPGroup, prepack: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, HIDDEN, generator=gen)
    gate, up = (torch.randn(INTER, HIDDEN, generator=gen) for _ in range(2))
    gate_b, up_b = (torch.randn(INTER, generator=gen) for _ in range(2))
    full = MergedColumnLinear(HIDDEN, [INTER, INTER], bias=True)
    part = MergedColumnLinear(HIDDEN, [INTER, INTER], bias=True, tp=tp)
    for layer in (full, part):
        for shard, (w, b) in enumerate([(gate, gate_b), (up, up_b)]):
            _load(layer, "weight", w, shard)
            _load(layer, "bias", b, shard)
    start, end = balanced_range(INTER, tp.size, tp.rank)
    assert torch.equal(part.weight, torch.cat([gate[start:end], up[start:end]]))
    assert torch.equal(part.bias, torch.cat([gate_b[start:end], up_b[start:end]]))
    # an already merged checkpoint tensor (shard id None) is cut the same way
    merged = MergedColumnLinear(HIDDEN, [INTER, INTER], bias=True, tp=tp)
    _load(merged, "weight", full.weight.detach())
    _load(merged, "bias", full.bias.detach())
    assert torch.equal(merged.weight, part.weight) and torch.equal(merged.bias, part.bias)

    _pack(prepack, full, part)
    ref_gate, ref_up = full(x).split(INTER, dim=-1)
    expected = torch.cat([ref_gate[:, start:end], ref_up[:, start:end]], dim=-1)
    torch.testing.assert_close(part(x), expected)


def _qkv(tp: TPGroup, prepack: bool, num_heads: int, num_kv_heads: int) -> dict[str, int]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, HIDDEN, generator=gen)
    d = HEAD_DIM
    q, k, v = (
        torch.randn(n * d, HIDDEN, generator=gen) for n in (num_heads,) + (num_kv_heads,) * 2
    )
    qb, kb, vb = (torch.randn(n * d, generator=gen) for n in (num_heads,) + (num_kv_heads,) * 2)
    layout = head_layout(num_heads, num_kv_heads, tp.size, tp.rank)
    full = QKVLinear(HIDDEN, d, num_heads, num_kv_heads, bias=True)
    part = QKVLinear(HIDDEN, d, num_heads, num_kv_heads, bias=True, layout=layout)
    for layer in (full, part):
        for shard, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            _load(layer, "weight", w, shard)
            _load(layer, "bias", b, shard)
    (q0, q1), (k0, k1) = layout.q_heads, layout.kv_heads
    assert torch.equal(
        part.weight, torch.cat([q[q0 * d : q1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]])
    )
    assert torch.equal(
        part.bias, torch.cat([qb[q0 * d : q1 * d], kb[k0 * d : k1 * d], vb[k0 * d : k1 * d]])
    )
    merged = QKVLinear(HIDDEN, d, num_heads, num_kv_heads, bias=True, layout=layout)
    _load(merged, "weight", full.weight.detach())
    _load(merged, "bias", full.bias.detach())
    assert torch.equal(merged.weight, part.weight) and torch.equal(merged.bias, part.bias)

    _pack(prepack, full, part)
    ref_q, ref_k, ref_v = full.split(full(x))
    out_q, out_k, out_v = part.split(part(x))
    torch.testing.assert_close(out_q, ref_q[:, q0 * d : q1 * d])
    torch.testing.assert_close(out_k, ref_k[:, k0 * d : k1 * d])
    torch.testing.assert_close(out_v, ref_v[:, k0 * d : k1 * d])
    return {"q_heads": part.num_heads, "kv_heads": part.num_kv_heads}


def _row(tp: TPGroup, prepack: bool, dtype: torch.dtype) -> None:
    """down_proj (balanced input split) and o_proj (the 9/3 layout's q heads), with a bias
    that must be added once, after the all-reduce."""
    gen = torch.Generator().manual_seed(2)
    layout = head_layout(9, 3, tp.size, tp.rank)
    o_in = 9 * HEAD_DIM
    cases = [
        (INTER, balanced_range(INTER, tp.size, tp.rank)),
        (o_in, (layout.q_heads[0] * HEAD_DIM, layout.q_heads[1] * HEAD_DIM)),
    ]
    for input_size, (start, end) in cases:
        x = torch.randn(4, input_size, generator=gen).to(dtype)
        w = torch.randn(HIDDEN, input_size, generator=gen)
        b = torch.randn(HIDDEN, generator=gen)
        full = RowLinear(input_size, HIDDEN, bias=True).to(dtype)
        explicit = (start, end) if input_size == o_in else None
        part = RowLinear(input_size, HIDDEN, bias=True, tp=tp, input_range=explicit).to(dtype)
        for layer in (full, part):
            _load(layer, "weight", w)
            _load(layer, "bias", b)
        assert torch.equal(part.weight, w[:, start:end].to(dtype))
        _pack(prepack, full, part)
        if dtype == torch.float32:
            torch.testing.assert_close(part(x[:, start:end]), full(x))
            continue
        # bf16: each rank's partial sum is rounded before the reduce, so tp=2 is not tp=1's
        # bits; both are within a few bf16 steps (outputs are |y| < 8) of the exact result.
        exact = F.linear(x.float(), w.to(dtype).float(), b.to(dtype).float())
        for out in (full(x), part(x[:, start:end])):
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), exact, rtol=0.02, atol=0.08)


def _vocab(tp: TPGroup, dtype: torch.dtype) -> dict[str, Any]:
    vocab, dim = 11, 6  # 6 + 5 rows: rank 1's shard has one zero padding row
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype)
    head_bias = torch.randn(vocab, generator=gen).to(dtype)
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])
    hidden = torch.randn(4, dim, generator=gen).to(dtype)

    embed = VocabEmbedding(vocab, dim, tp=tp).to(dtype)
    _load(embed, "weight", weight)
    assert torch.equal(embed(ids), F.embedding(ids, weight))  # one non-zero per sum: exact

    tied = LMHead(vocab, dim, tp=tp).to(dtype)
    tied.tie_to(embed)
    head = LMHead(vocab, dim, bias=True, tp=tp).to(dtype)
    _load(head, "weight", weight)
    _load(head, "bias", head_bias)
    # the tp=1 twins: the gathered logits are theirs (each logit is one whole dot product)
    full_embed = VocabEmbedding(vocab, dim).to(dtype)
    _load(full_embed, "weight", weight)
    full_tied = LMHead(vocab, dim).to(dtype)
    full_tied.tie_to(full_embed)
    full_head = LMHead(vocab, dim, bias=True).to(dtype)
    _load(full_head, "weight", weight)
    _load(full_head, "bias", head_bias)
    # A stand-in for the ForwardBatch fields LogitsProcessor reads.
    rows = SimpleNamespace(logits_indices=torch.tensor([0, 2, 3]), argmax_only=False)
    for ours, twin in ((tied, full_tied), (head, full_head)):
        got = LogitsProcessor(vocab, tp)(hidden, ours, rows)
        assert got.dtype == torch.float32 and got.shape == (3, vocab)
        torch.testing.assert_close(got, LogitsProcessor(vocab)(hidden, twin, rows))
    layout = vocab_layout(vocab, tp.size, tp.rank)
    return {
        "rows": tuple(embed.weight.shape),
        "padding_zero": bool((embed.weight[layout.end - layout.start :] == 0).all()),
        "bias_padding_zero": bool((head.bias[layout.end - layout.start :] == 0).all()),
    }


@pytest.mark.parametrize("prepack", [False, True])
def test_column_and_row_layers_match_tp1(tp2: TPRanks, prepack: bool) -> None:
    tp2.run(_merged_column, prepack)
    tp2.run(_row, prepack, torch.float32)
    # SmolLM2's uneven split: rank 0 holds KV head 0 and its 3 q heads, rank 1 the rest
    assert tp2.run(_qkv, prepack, 9, 3) == [
        {"q_heads": 3, "kv_heads": 1},
        {"q_heads": 6, "kv_heads": 2},
    ]
    # fewer KV heads than ranks: both hold KV head 0 and 2 of its 4 q heads
    assert tp2.run(_qkv, prepack, 4, 1) == [{"q_heads": 2, "kv_heads": 1}] * 2


def test_row_linear_bf16_close_to_tp1(tp2: TPRanks) -> None:
    tp2.run(_row, False, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_embedding_and_gathered_logits(tp2: TPRanks, dtype: torch.dtype) -> None:
    r0, r1 = tp2.run(_vocab, dtype)
    assert r0["rows"] == r1["rows"] == (6, 6)
    assert r1["padding_zero"] and r1["bias_padding_zero"]
