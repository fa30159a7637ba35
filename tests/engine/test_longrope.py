"""Phi-3's LongRoPE (`rope_scaling` type `longrope`, partial rotary as Phi-4-mini's) on a tiny
random Phi-3 whose original context is 48 positions.

Below it, greedy tokens through the scheduler equal HF's `generate`. Across it, the
positions a request has cached keep their short-factor rotation and new ones take the long
factors: the logits equal HF's own model run token by token over a KV cache. (HF's
`generate` instead recomputes the whole sequence with the long factors at the crossing; see
`srt/layers/rotary_embedding.py`.)"""

from __future__ import annotations

import random

import pytest
import torch

from attention.torch_native_backend import TorchNativeAttnBackend
from managers.inprocess import InProcessDriver
from srt.configs.model_config import ModelConfig
from srt.model_loader.loader import get_model
from srt.server_args import ServerArgs
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy
from tests.engine.tiny_models import VOCAB, save_tiny_model
from tests.srt.forward_helpers import ForwardBatchBuilder

ORIGINAL = 48  # tiny_config("phi3-long")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[str, object]:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("phi3-long", tmp_path_factory.mktemp("phi3"))
    return str(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_greedy_equals_hf_generate_below_the_original_context(phi3) -> None:
    folder, hf = phi3
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in (3, 17, 30)]
    driver = InProcessDriver(
        ServerArgs(
            model_path=folder, dtype="float32", skip_tokenizer_init=True, max_total_tokens=2048
        )
    )
    new = ORIGINAL - 30
    outs = driver.generate(prompts, {"max_new_tokens": new, "temperature": 0, "ignore_eos": True})
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(hf, prompt, out["output_ids"], hf_greedy(hf, prompt, new))


def test_logits_across_the_original_context_equal_hf_with_a_kv_cache(phi3) -> None:
    from transformers import DynamicCache

    folder, hf = phi3
    rng = random.Random(2)
    sequence = [rng.randrange(2, VOCAB - 1) for _ in range(ORIGINAL + 12)]
    prompt = 30
    expected = []
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        out = hf(torch.tensor([sequence[:prompt]]), cache=cache, use_cache=True)
        expected.append(out.logits[0, -1])
        for pos in range(prompt, len(sequence)):
            out = hf(
                torch.tensor([[sequence[pos]]]),
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[pos]]),
            )
            expected.append(out.logits[0, -1])
    config = ModelConfig.from_path(folder, dtype="float32")
    model = get_model(config)
    builder = ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        num_slots=256,
        backend=TorchNativeAttnBackend(),
    )
    got = []
    with torch.inference_mode():
        batch = builder.build([(0, sequence[:prompt])])
        got.append(model(batch.input_ids, batch.positions, batch)[0])
        for pos in range(prompt, len(sequence)):
            batch = builder.build([(0, [sequence[pos]])])
            got.append(model(batch.input_ids, batch.positions, batch)[0])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-4, atol=1e-4)
    # HF did switch to the long factors past the original context, so they were compared.
    rotary = hf.model.rotary_emb
    assert not torch.equal(rotary.original_inv_freq, rotary.inv_freq)
