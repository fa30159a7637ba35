"""Sharded models on two gloo ranks against their tp=1 twins: dummy weights drawn per shard
gather to the tp=1 draw, a checkpoint loads into shards, and a tp=2 forward gives the tp=1
logits. The functions that run on the ranks are top-level so the harness can send them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attention.torch_native_backend import TorchNativeAttnBackend
from srt.configs.model_config import model_sliding_window
from srt.distributed import TPGroup, head_layout
from srt.model_loader.loader import DUMMY_HIGH, DUMMY_LOW, DUMMY_SEED, init_dummy_weights
from tests.distributed.tp_harness import TPRanks

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
    # A window of 4 over prompts of 7 and 3 tokens and a decode step.
    "mistral": (
        "MistralForCausalLM",
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "vocab_size": 101,
            "sliding_window": 4,
        },
    ),
    # Experts sharded by their intermediate size (37: 18 and 19 rows per rank); one dense
    # layer and one sparse one.
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "hidden_size": 32,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "moe_intermediate_size": 37,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "vocab_size": 103,
            "tie_word_embeddings": False,
        },
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 37,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "vocab_size": 104,
        },
    ),
    # Merged qkv_proj / gate_up_proj checkpoint tensors cut by the ranks; LongRoPE.
    "phi3": (
        "Phi3ForCausalLM",
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "vocab_size": 105,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 4,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.5],
                "long_factor": [2.0, 4.0],
            },
            "pad_token_id": 0,
        },
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "hidden_size": 32,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "vocab_size": 106,
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "hidden_size": 32,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 40,
            "vocab_size": 102,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": False,
        },
    ),
}
# Where the config class is not the architecture's name with "Config".
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def _config(name: str) -> Any:
    import transformers

    arch, kwargs = MODELS[name]
    config_cls = getattr(
        transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config"))
    )
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


def _hf_weights(model: nn.Module, merged: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Random weights for `model` (a tp=1 model) under HF's separate q/k/v, gate/up names,
    or (`merged`, as Phi-3 checkpoints hold them) one qkv_proj and one gate_up_proj."""
    gen = torch.Generator().manual_seed(4)
    attn = model.model.layers[0].self_attn.qkv_proj
    out: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        if "norm" in name:
            full = 1.0 + 0.2 * torch.randn(param.shape, generator=gen)
        else:
            full = 0.08 * torch.randn(param.shape, generator=gen)
        if merged:
            out.append((name, full))
        elif "qkv_proj" in name:
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
        elif name.endswith(".mlp.w13"):  # experts: HF's per-expert tensors
            prefix = name.removesuffix("w13") + "experts"
            for e, (gate, up) in enumerate(t.chunk(2) for t in full):
                out += [
                    (f"{prefix}.{e}.gate_proj.weight", gate),
                    (f"{prefix}.{e}.up_proj.weight", up),
                ]
        elif name.endswith(".mlp.w2"):
            prefix = name.removesuffix("w2") + "experts"
            out += [(f"{prefix}.{e}.down_proj.weight", down) for e, down in enumerate(full)]
        else:
            out.append((name, full))
    return out


def _forward_logits(model: nn.Module, num_kv_heads: int) -> list[torch.Tensor]:
    """Logits of a ragged extend (every position) and then one decode step."""
    from tests.srt.forward_helpers import ForwardBatchBuilder

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    backend = TorchNativeAttnBackend(sliding_window=model_sliding_window(config))
    builder = ForwardBatchBuilder(
        config.num_hidden_layers, num_kv_heads, head_dim, num_slots=64, backend=backend
    )
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
    weights = _hf_weights(single, merged=name == "phi3")
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


@pytest.mark.parametrize(
    ("name", "prepack"),
    [
        ("llama", True),
        ("qwen2", False),
        ("qwen3", True),
        ("mistral", True),
        ("gemma2", True),
        ("gemma3", True),
        ("qwen3-moe", True),
        ("mixtral", False),
        ("phi3", True),
    ],
)
def test_model_forward_tp2_equals_tp1(tp2: TPRanks, name: str, prepack: bool) -> None:
    r0, r1 = tp2.run(_model_pair, name, prepack)
    for a, b in zip(r0, r1, strict=True):
        assert torch.equal(a, b)  # every rank samples from the same gathered logits
