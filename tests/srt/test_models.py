"""Our Llama / Qwen2 / Qwen3 vs the HF implementations (the oracle) on tiny random configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from srt.kernels.layer_ops import layer_ops_kernel
from srt.layers import fused_kernels
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import get_rope, rope_settings_from_config
from srt.model_executor.forward_batch import ForwardMode
from srt.models.llama import LlamaForCausalLM
from srt.models.registry import get_model_class
from tests.srt.forward_helpers import ForwardBatchBuilder

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**TINY),
    "llama3_rope": LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
    "llama_linear_tied": LlamaConfig(
        **TINY,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        tie_word_embeddings=True,
    ),
    "llama_dynamic": LlamaConfig(
        **TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "qwen2": Qwen2Config(**TINY),
    "qwen3_tied": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
}
ARCH = {
    LlamaConfig: "LlamaForCausalLM",
    Qwen2Config: "Qwen2ForCausalLM",
    Qwen3Config: "Qwen3ForCausalLM",
}


def build_pair(
    config: PretrainedConfig, dtype: torch.dtype = torch.float32, layer_ops: str = "torch"
):
    """(hf_model, our_model) with the same random weights, larger than HF's 0.02 init;
    `layer_ops="cpu"` gives ours the compiled CPU layer ops (`fused_kernels.enable_cpu_ops`)."""
    config._attn_implementation = "eager"
    arch = ARCH[type(config)]
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    hf = hf.to(dtype)
    ours = get_model_class([arch])(config).to(dtype)
    ours.load_weights(hf.state_dict().items())
    if layer_ops == "cpu":
        if layer_ops_kernel() is None:
            pytest.skip("no C compiler: the CPU layer ops cannot build")
        assert fused_kernels.enable_cpu_ops(ours) > 0
    return hf, ours


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def builder_for(config: PretrainedConfig, dtype: torch.dtype = torch.float32):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ForwardBatchBuilder(
        config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype=dtype
    )


@pytest.mark.parametrize("layer_ops", ["torch", "cpu"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_extend_all_logits_ragged_batch(name: str, layer_ops: str):
    config = CONFIGS[name]
    hf, ours = build_pair(config, layer_ops=layer_ops)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 1, 13)]
    builder = builder_for(config)
    num_tokens = sum(map(len, prompts))
    batch = builder.build(list(enumerate(prompts)), logits_indices=torch.arange(num_tokens))
    with torch.no_grad():
        logits = ours(batch.input_ids, batch.positions, batch)
    assert logits.dtype == torch.float32 and logits.shape == (num_tokens, 256)
    expected = torch.cat([hf_logits(hf, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_ops", ["torch", "cpu"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_chunk_then_decode_matches_full_forward(name: str, layer_ops: str):
    config = CONFIGS[name]
    hf, ours = build_pair(config, layer_ops=layer_ops)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    builder = builder_for(config)

    def run(new: list[tuple[int, list[int]]], mode: ForwardMode | None = None) -> None:
        batch = builder.build(new, mode=mode)
        with torch.no_grad():
            logits = ours(batch.input_ids, batch.positions, batch)  # last token of each
        assert logits.shape == (len(new), 256)
        for row, (rid, ids) in enumerate(new):
            expected = hf_logits(hf, seqs[rid][: builder.seq_lens[rid]])[-1]
            torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)

    # request 1 is prefilled in two chunks; the second chunk extends a cached prefix
    run([(0, seqs[0]), (1, seqs[1][:4]), (2, seqs[2])])
    run([(1, seqs[1][4:])])
    for step in range(4):
        for rid in range(3):
            seqs[rid].append((7 * step + 31 * rid) % 256)
        run([(rid, [seqs[rid][-1]]) for rid in range(3)])
    seqs[0] += [3, 4, 5]
    seqs[2].append(77)
    run([(0, [3, 4, 5]), (2, [77])], mode=ForwardMode.MIXED)


@pytest.mark.parametrize("layer_ops", ["torch", "cpu"])
def test_last_layer_runs_only_the_rows_that_get_logits(layer_ops: str):
    """An extend's last layer runs o_proj and the MLP only at the logits rows (here the
    prompt-logprob rows of one request, a one-token request and the last row of a third),
    every other layer at all rows; the logits still equal HF's."""
    config = CONFIGS["llama"]
    hf, ours = build_pair(config, layer_ops=layer_ops)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (6, 1, 14)]
    wanted = [(0, 3), (0, 4), (0, 5), (1, 0), (2, 13)]  # (request, position)
    starts = [0, 6, 7]
    rows = torch.tensor([starts[r] + i for r, i in wanted])
    batch = builder_for(config).build(list(enumerate(prompts)), logits_indices=rows)
    seen: dict[str, int] = {}

    def spy(name: str):
        return lambda _module, args: seen.__setitem__(name, args[0].shape[0])

    first, last = ours.model.layers[0], ours.model.layers[-1]
    for name, module in [
        ("first.o_proj", first.self_attn.o_proj),
        ("first.mlp", first.mlp),
        ("last.o_proj", last.self_attn.o_proj),
        ("last.mlp", last.mlp),
    ]:
        module.register_forward_pre_hook(spy(name))
    with torch.no_grad():
        logits = ours(batch.input_ids, batch.positions, batch)
    assert seen == {"first.o_proj": 21, "first.mlp": 21, "last.o_proj": 5, "last.mlp": 5}
    expected = torch.stack([hf_logits(hf, prompts[r])[i] for r, i in wanted])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_ops", ["torch", "cpu"])
def test_bf16_model_close_to_hf_bf16(layer_ops: str):
    hf, ours = build_pair(CONFIGS["qwen3_tied"], torch.bfloat16, layer_ops)
    builder = builder_for(CONFIGS["qwen3_tied"], torch.bfloat16)
    prompt = list(range(10, 30))
    batch = builder.build([(0, prompt)], logits_indices=torch.arange(len(prompt)))
    with torch.no_grad():
        logits = ours(batch.input_ids, batch.positions, batch)
    expected = hf_logits(hf, prompt)
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()


def test_rms_norm_matches_hf_bitwise():
    x = torch.randn(5, 64).to(torch.bfloat16)
    residual = torch.randn(5, 64).to(torch.bfloat16)
    ours, theirs = RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
        ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "llama_linear_tied"])
def test_rope_matches_hf(name: str):
    config = CONFIGS[name]
    base, scaling, _ = rope_settings_from_config(config)
    rope = get_rope(16, 16, config.max_position_embeddings, base, scaling).to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32  # model.to(bf16) keeps the cache
    positions = torch.tensor([0, 1, 5, 31, 64, 127])
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rope(positions, q.reshape(6, -1), k.reshape(6, -1))
    assert torch.equal(q_out.view(6, 4, 16), q_ref[0].transpose(0, 1))
    assert torch.equal(k_out.view(6, 2, 16), k_ref[0].transpose(0, 1))


def test_dynamic_rope_matches_hf_incremental_generation():
    config = CONFIGS["llama_dynamic"]
    base, scaling, _ = rope_settings_from_config(config)
    rope = get_rope(16, 16, config.max_position_embeddings, base, scaling)
    assert rope.max_position == 256
    q, k = torch.randn(1, 4, 16), torch.randn(1, 2, 16)
    for p in (3, 127, 128, 200, 255):
        # HF generating token p with a KV cache sees a sequence of length p + 1
        cos, sin = LlamaRotaryEmbedding(config)(q, torch.tensor([[p]]))
        q_ref, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q_out, _ = rope(torch.tensor([p]), q.reshape(1, -1), k.reshape(1, -1))
        torch.testing.assert_close(q_out.view(1, 4, 16), q_ref[0].transpose(0, 1))


def test_load_weights_reports_missing_and_registry_errors():
    config = CONFIGS["llama"]
    model = LlamaForCausalLM(config)
    weights = [(n, t) for n, t in build_pair(config)[0].state_dict().items() if "k_proj" not in n]
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[k\]"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    assert get_model_class(["MistralForCausalLM"]) is LlamaForCausalLM


def test_rope_lookup_shared_across_layers_but_not_stale() -> None:
    from srt.layers.rotary_embedding import get_rope

    rope = get_rope(16, 16, 64, 10000.0, None)
    q, k = torch.randn(3, 2 * 16), torch.randn(3, 2 * 16)
    positions = torch.tensor([0, 5, 9])
    first = rope(positions, q, k)
    assert rope._cached_key[0] is positions
    again = rope(positions, q, k)  # a second layer, same forward: cached lookup
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    positions[1] = 7  # a persistent buffer updated in place must not reuse the old values
    fresh = get_rope(16, 16, 64, 10000.0, None)(positions.clone(), q, k)
    updated = rope(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(fresh, updated, strict=True))
