"""The fused CPU decode layer (cpu_decode_layer_runner.py, srt/kernels/csrc/decode_layer.c)
against the modules it replaces, which run the same kernels one call at a time: equal logits
and equal KV pools, bit for bit; and against HF's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from attention.cpu_backend import CpuAttnBackend
from srt.kernels.decode_layer import decode_layer_kernel
from srt.kernels.linear import packed_linear_kernel
from srt.layers.cpu_packed import SMALL_ROWS, prepack_cpu_weights
from srt.layers.quantization import quantize_model
from srt.model_executor.cpu_decode_layer_runner import FusedDecode, enable_fused_decode
from tests.srt.forward_helpers import ForwardBatchBuilder
from tests.srt.test_models import build_pair, hf_logits

pytestmark = pytest.mark.skipif(
    decode_layer_kernel() is None, reason="no C compiler: the fused decode layer cannot build"
)
NO_BF16 = "no AVX512_BF16: no bfloat16 panels, bfloat16 models run the modules"

# Head dim 64 (the decode kernel's), query groups of 2 and 3; rope partial / llama3 covered
# by the kernels' own tests.
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 320,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
CONFIGS = {
    "llama": LlamaConfig(**SHAPE),
    "qwen2_qkv_bias": Qwen2Config(**SHAPE),
    "llama_gqa3_tied": LlamaConfig(
        **{**SHAPE, "num_attention_heads": 6, "hidden_size": 384}, tie_word_embeddings=True
    ),
}


def fused_model(name: str, dtype: torch.dtype = torch.float32, quantization: str = "none"):
    hf, ours = build_pair(CONFIGS[name], dtype, layer_ops="cpu")
    if quantization != "none":
        assert quantize_model(ours, quantization) > 0
    assert prepack_cpu_weights(ours) > 0 or quantization != "none"
    fused = enable_fused_decode(ours)
    assert isinstance(fused, FusedDecode) and ours.model.fused_decode is fused
    return hf, ours, fused


def builder(config, dtype: torch.dtype = torch.float32) -> ForwardBatchBuilder:
    head_dim = config.hidden_size // config.num_attention_heads
    backend = CpuAttnBackend(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    return ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        head_dim,
        dtype=dtype,
        num_slots=2048,
        max_reqs=80,
        max_context_len=512,
        backend=backend,
    )


def serve(model, fused: FusedDecode | None, prompts: list[list[int]], steps: int):
    """Prefill `prompts`, fork request 0's cached prefix into one more request (a radix hit:
    the same KV slots; the first prompt is longer than MIN_SHARED_TOKENS, so every decode
    step plans it as a shared prefix), then decode `steps` tokens for all; returns the decode
    steps' logits, the final pool and the requests' token lists."""
    model.model.fused_decode = fused
    b = builder(model.config, model.model.embed_tokens.weight.dtype)
    seqs = [list(p) for p in prompts]
    run, plans = [], []
    with torch.no_grad():
        batch = b.build(list(enumerate(seqs)))
        model(batch.input_ids, batch.positions, batch)
        shared = b.share_prefix(0, len(seqs))
        seqs.append(seqs[0][:shared] + [5, 6, 7])
        batch = b.build([(len(seqs) - 1, [5, 6, 7])])
        model(batch.input_ids, batch.positions, batch)
        for step in range(steps):
            for rid, seq in enumerate(seqs):
                seq.append((11 * step + 29 * rid) % 256)
            batch = b.build([(rid, [seq[-1]]) for rid, seq in enumerate(seqs)])
            plans.append(batch.attn_metadata)
            run.append(model(batch.input_ids, batch.positions, batch))
    assert all(plan is not None and plan.groups == 1 for plan in plans)  # the fork's prefix
    return run, b.kv_pool, seqs


_PANELS = packed_linear_kernel()
BF16_PANELS = _PANELS is not None and _PANELS.accepts(torch.zeros(2, 2, dtype=torch.bfloat16))
CASES = [pytest.param(name, torch.float32, id=name) for name in sorted(CONFIGS)] + [
    pytest.param(
        name,
        torch.bfloat16,
        id=f"{name}-bf16",
        marks=pytest.mark.skipif(not BF16_PANELS, reason=NO_BF16),
    )
    for name in ("llama", "qwen2_qkv_bias")
]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_fused_decode_equals_the_modules_bitwise(name: str, dtype: torch.dtype):
    """Same logits and same K/V in the pool, bit for bit, as the layer modules (float32, and
    bfloat16 where the CPU has the bf16 panels); the shared prefix of the forked request is
    planned and read once (the backend's plan reaches the kernel); float32 logits match HF's."""
    hf, ours, fused = fused_model(name, dtype)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (80, 3, 150)]
    calls = []
    kernel = fused._kernel

    def counting(*args):  # a spy: the fused path really runs, one call per layer and step
        calls.append(args)
        return kernel(*args)

    fused._kernel = counting
    got, got_pool, seqs = serve(ours, fused, prompts, steps=4)
    assert len(calls) == 4 * ours.config.num_hidden_layers
    want, want_pool, _ = serve(ours, None, prompts, steps=4)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), step
    for layer in range(ours.config.num_hidden_layers):
        for got_kv, want_kv in zip(
            got_pool.get_kv_buffer(layer), want_pool.get_kv_buffer(layer), strict=True
        ):
            assert torch.equal(got_kv, want_kv), layer
    if dtype != torch.float32:
        return
    for rid, seq in enumerate(seqs):
        expected = hf_logits(hf, seq)[-1]
        torch.testing.assert_close(got[-1][rid], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("name", "quantization"), [("qwen2_qkv_bias", "int4"), ("llama_gqa3_tied", "int8")]
)
def test_fused_decode_equals_the_modules_on_quantized_weights(name: str, quantization: str):
    """Weights kept quantized (biases, a tied table looked up in the LM head's panels): the
    fused layer runs the same quantized kernel as the modules, bit for bit."""
    _, ours, fused = fused_model(name, quantization=quantization)
    assert ours.model.layers[0].mlp.down_proj.quant is not None
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (80, 5)]
    got, got_pool, _ = serve(ours, fused, prompts, steps=3)
    want, want_pool, _ = serve(ours, None, prompts, steps=3)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for layer in range(ours.config.num_hidden_layers):
        for got_kv, want_kv in zip(
            got_pool.get_kv_buffer(layer), want_pool.get_kv_buffer(layer), strict=True
        ):
            assert torch.equal(got_kv, want_kv), layer


def test_batches_it_does_not_take_run_the_modules():
    """Extend batches and decode batches over the panels' row limit return None from `run`
    (the modules' loop runs them) and still give the modules' results."""
    _, ours, fused = fused_model("llama")
    config = ours.config
    b = builder(config)
    prompts = [[(7 * i + j) % 256 for j in range(4)] for i in range(SMALL_ROWS + 1)]
    with torch.no_grad():
        batch = b.build(list(enumerate(prompts)))
        hidden = ours.model.embed_tokens(batch.input_ids)
        assert fused.run(batch.positions, hidden, batch) is None  # extend
        batch = b.build([(rid, [1]) for rid in range(SMALL_ROWS + 1)])
        hidden = ours.model.embed_tokens(batch.input_ids)
        assert fused.run(batch.positions, hidden, batch) is None  # 65 rows
        logits = ours(batch.input_ids, batch.positions, batch)
    assert logits.shape == (SMALL_ROWS + 1, 256) and torch.isfinite(logits).all()


@pytest.mark.parametrize("case", ["qk_norm", "no_panels", "float16"])
def test_models_it_cannot_run_keep_the_modules(case, caplog):
    """Qwen3 (q/k norms), a matmul without packed panels (bfloat16 on a CPU without
    AVX512_BF16), float16 weights: no fused decode, with the reason logged."""
    config = Qwen3Config(**SHAPE, head_dim=64) if case == "qk_norm" else LlamaConfig(**SHAPE)
    dtype = torch.float16 if case == "float16" else torch.float32
    _, ours = build_pair(config, dtype, layer_ops="cpu")
    prepack_cpu_weights(ours)
    if case == "no_panels":
        ours.model.layers[1].mlp.down_proj.packed.panels = None
    why = {"qk_norm": "q/k norm", "no_panels": "no packed", "float16": "torch.float16"}[case]
    with caplog.at_level("INFO", logger="srt.model_executor.cpu_decode_layer_runner"):
        assert enable_fused_decode(ours) is None
    assert ours.model.fused_decode is None
    assert why in caplog.text


def test_position_outside_the_rope_cache_is_an_index_error():
    """A position past the RoPE cache fails the step with an IndexError, as the modules do."""
    _, ours, fused = fused_model("llama")
    b = builder(ours.config)
    with torch.no_grad():
        batch = b.build([(0, [1, 2, 3])])
        ours(batch.input_ids, batch.positions, batch)
        batch = b.build([(0, [4])])
        batch.positions[0] = ours.config.max_position_embeddings
        hidden = ours.model.embed_tokens(batch.input_ids)
        with pytest.raises(IndexError, match="RoPE cache"):
            fused.run(batch.positions, hidden, batch)
