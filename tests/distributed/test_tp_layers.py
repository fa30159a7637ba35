"""Sharded layers and models on two gloo ranks against their tp=1 twins.

Every rank builds the same full weights from one seeded generator, loads them into a tp=1
layer and into its tensor-parallel shard, and compares: a column-parallel layer's output
must be its slice of the tp=1 output, a row-parallel layer's (and the vocabulary-parallel
embedding's and logits') the whole tp=1 output. Head splits cover the uneven 9/3 heads of
SmolLM2 and a KV head replicated over both ranks (4 q heads over 1 KV head). The functions
that run on the ranks are top-level so the harness can send them.
"""

from __future__ import annotations

from pathlib import Path
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
from srt.model_loader.loader import DUMMY_HIGH, DUMMY_LOW, DUMMY_SEED, init_dummy_weights
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


# --- whole models ------------------------------------------------------------------------

# (architecture, config kwargs): the uneven 9/3 split with tied embeddings, Qwen2's q/k/v
# biases over a replicated KV head, Qwen3's per-head norms; odd vocabularies and MLP sizes.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        {
            "hidden_size": 72,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 46,
            "vocab_size": 101,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "intermediate_size": 37,
            "vocab_size": 100,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {
            "hidden_size": 32,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "vocab_size": 99,
            "tie_word_embeddings": False,
        },
    ),
}


def _config(name: str) -> Any:
    import transformers

    arch, kwargs = MODELS[name]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-6, **kwargs
    )
    config.architectures = [arch]
    return config


def _build(name: str, tp: TPGroup | None = None) -> nn.Module:
    from srt.models.registry import get_model_class

    config = _config(name)
    cls = get_model_class(config.architectures)
    return cls(config) if tp is None else cls(config, tp=tp)


def _dummy_state(tp: TPGroup, name: str) -> dict[str, torch.Tensor]:
    model = _build(name, tp)
    init_dummy_weights(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _gather(config: Any, param: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the ranks' shards, by the layout rules (independent of the
    layers' own cutting code)."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if "qkv_proj" in param:
        layouts = [
            head_layout(config.num_attention_heads, config.num_key_value_heads, 2, r)
            for r in range(2)
        ]
        parts = [
            s.split([lay.num_heads * d, lay.num_kv_heads * d, lay.num_kv_heads * d])
            for s, lay in zip(shards, layouts, strict=True)
        ]
        qs = torch.cat([p[0] for p in parts])
        if layouts[0].replicated_kv:  # one KV head on both ranks: the same rows twice
            assert torch.equal(parts[0][1], parts[1][1]) and torch.equal(parts[0][2], parts[1][2])
            return torch.cat([qs, parts[0][1], parts[0][2]])
        return torch.cat([qs, *(torch.cat([p[i] for p in parts]) for i in (1, 2))])
    if "gate_up_proj" in param:
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in (0, 1)])
    if "o_proj" in param or "down_proj" in param:
        return torch.cat(shards, dim=1)
    if "embed_tokens" in param or "lm_head" in param:
        rows = torch.cat(shards)
        assert (rows[config.vocab_size :] == 0).all(), "vocabulary padding must stay zero"
        return rows[: config.vocab_size]
    assert torch.equal(shards[0], shards[1]), param  # replicated
    return shards[0]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_dummy_weights_of_tp2_gather_to_tp1(tp2: TPRanks, name: str) -> None:
    single = _build(name)
    init_dummy_weights(single)
    states = tp2.run(_dummy_state, name)
    expected = dict(single.named_parameters())
    assert list(states[0]) == list(expected)  # same parameters, same order
    for param, full in expected.items():
        gathered = _gather(_config(name), param, [s[param] for s in states])
        assert torch.equal(gathered, full), param


def test_dummy_weights_at_tp1_are_the_plain_draws() -> None:
    """tp=1 draws exactly what one uniform_ per parameter in order draws."""
    model, plain = _build("llama"), _build("llama")
    init_dummy_weights(model)
    gen = torch.Generator().manual_seed(DUMMY_SEED)
    with torch.no_grad():
        for param in plain.parameters():
            param.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)
    for (n, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def _load_checkpoint(tp: TPGroup, folder: str) -> dict[str, torch.Tensor]:
    from srt.configs.model_config import ModelConfig
    from srt.model_loader.loader import get_model

    model = get_model(ModelConfig.from_path(folder, dtype="float32"), "auto", "cpu", tp)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_get_model_reads_a_checkpoint_into_shards(tp2: TPRanks, tmp_path: Path) -> None:
    """A saved HF Qwen2 (q/k/v biases, one KV head on both ranks) through get_model."""
    from srt.configs.model_config import ModelConfig
    from srt.model_loader.loader import get_model
    from tests.engine.tiny_models import save_tiny_model

    folder = str(save_tiny_model("qwen2", tmp_path / "qwen2", num_kv_heads=1))
    single = get_model(ModelConfig.from_path(folder, dtype="float32"))
    states = tp2.run(_load_checkpoint, folder)
    for param, full in single.named_parameters():
        assert torch.equal(_gather(single.config, param, [s[param] for s in states]), full)


def _hf_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Random weights for `model` (a tp=1 model) under HF's separate q/k/v, gate/up names."""
    gen = torch.Generator().manual_seed(4)
    attn = model.model.layers[0].self_attn.qkv_proj
    out: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        if "norm" in name:
            full = 1.0 + 0.2 * torch.randn(param.shape, generator=gen)
        else:
            full = 0.08 * torch.randn(param.shape, generator=gen)
        if "qkv_proj" in name:
            parts = full.split([attn.q_size, attn.kv_size, attn.kv_size])
            out += [
                (name.replace("qkv_proj", p), t)
                for p, t in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True)
            ]
        elif "gate_up_proj" in name:
            gate, up = full.chunk(2)
            out += [
                (name.replace("gate_up_proj", "gate_proj"), gate),
                (name.replace("gate_up_proj", "up_proj"), up),
            ]
        else:
            out.append((name, full))
    return out


def _forward_logits(model: nn.Module, num_kv_heads: int) -> list[torch.Tensor]:
    """Logits of a ragged extend (every position) and then one decode step."""
    from tests.srt.forward_helpers import ForwardBatchBuilder

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    builder = ForwardBatchBuilder(config.num_hidden_layers, num_kv_heads, head_dim, num_slots=64)
    prompts = [[3, 17, 50, 2, 98, 7, 41], [60, 1, 22]]
    total = sum(map(len, prompts))
    logits = []
    with torch.inference_mode():
        batch = builder.build(list(enumerate(prompts)), logits_indices=torch.arange(total))
        logits.append(model(batch.input_ids, batch.positions, batch))
        batch = builder.build([(0, [5]), (1, [90])])
        logits.append(model(batch.input_ids, batch.positions, batch))
    return logits


def _model_pair(tp: TPGroup, name: str, prepack: bool) -> list[torch.Tensor]:
    from srt.layers.cpu_packed import prepack_cpu_weights

    single, part = _build(name), _build(name, tp)
    weights = _hf_weights(single)
    single.load_weights(weights)
    part.load_weights(weights)
    if prepack:
        assert prepack_cpu_weights(single) > 0 and prepack_cpu_weights(part) > 0
    expected = _forward_logits(single, single.head_layout.num_kv_heads)
    got = _forward_logits(part, part.head_layout.num_kv_heads)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape == (g.shape[0], single.config.vocab_size)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize(("name", "prepack"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_model_forward_tp2_equals_tp1(tp2: TPRanks, name: str, prepack: bool) -> None:
    r0, r1 = tp2.run(_model_pair, name, prepack)
    for a, b in zip(r0, r1, strict=True):
        assert torch.equal(a, b)  # every rank samples from the same gathered logits
