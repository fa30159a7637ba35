"""Every architecture's logits equal HF transformers' own implementation, float32: a prompt's
prefill (every position) and then 32 decode steps, on tiny random models built in-process.
The greedy tests (`test_greedy_vs_hf.py`, `test_sliding_window.py`) check the tokens through
the scheduler; this checks the numbers the model computes, position by position."""

from __future__ import annotations

import random

import pytest
import torch

from attention.torch_native_backend import TorchNativeAttnBackend
from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import get_model
from tests.engine.hf_reference import hf_greedy
from tests.engine.tiny_models import VOCAB, save_tiny_gemma3_multimodal, save_tiny_model
from tests.srt.forward_helpers import ForwardBatchBuilder

DECODE_STEPS = 32


def _save(arch: str, folder):
    if arch == "gemma3-multimodal":
        return save_tiny_gemma3_multimodal(folder)
    return save_tiny_model(arch, folder)


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "qwen2-window",
        "gemma2",
        "gemma3",
        "qwen3-moe",
        "mixtral",
        "phi3",
        "gemma3-multimodal",
    ],
)
def test_logits_equal_hf_prefill_and_decode(arch: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    folder = _save(arch, tmp_path)
    config = ModelConfig.from_path(str(folder), dtype="float32")
    model = get_model(config)
    if arch == "gemma3-multimodal":
        from transformers import Gemma3ForConditionalGeneration as AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompt = [rng.randrange(2, VOCAB - 1) for _ in range(40)]  # five windows where there is one
    tokens = hf_greedy(hf, prompt, DECODE_STEPS)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt + tokens])).logits[0, : len(prompt) + DECODE_STEPS - 1]
    backend = TorchNativeAttnBackend(sliding_window=config.sliding_window)
    builder = ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        num_slots=256,
        backend=backend,
    )
    got = []
    with torch.inference_mode():
        batch = builder.build([(0, prompt)], logits_indices=torch.arange(len(prompt)))
        got.append(model(batch.input_ids, batch.positions, batch))
        for token in tokens[:-1]:
            batch = builder.build([(0, [token])])
            got.append(model(batch.input_ids, batch.positions, batch))
    # float32 sums in another order than HF's (and MKL's order differs between CPUs): the
    # windowed Qwen2's last decode step was 1.1e-4 off on an AVX-512 Xeon, 1 logit of 36352.
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize(
    "arch", ["mistral", "gemma2", "gemma3", "qwen3-moe", "mixtral", "phi3", "gemma3-multimodal"]
)
def test_dummy_weights_run_every_architecture(arch: str, tmp_path) -> None:
    """`--load-format dummy`: random weights for the config alone, and a finite forward."""
    folder = _save(arch, tmp_path)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()  # the config alone
    config = ModelConfig.from_path(str(folder), dtype="float32")
    model = get_model(config, load_format="dummy")
    builder = ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        num_slots=64,
        backend=TorchNativeAttnBackend(sliding_window=config.sliding_window),
    )
    with torch.inference_mode():
        batch = builder.build([(0, [3, 17, 50, 2, 9, 7, 41, 5, 6, 8, 11])])
        logits = model(batch.input_ids, batch.positions, batch)
    assert logits.shape == (1, config.vocab_size) and torch.isfinite(logits).all()
