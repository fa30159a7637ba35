"""Sliding-window attention against HF transformers: a tiny Mistral (every layer windowed),
a tiny Qwen2 with `use_sliding_window` (its second layer only), a tiny Gemma 2 (its first
layer, with soft-capped scores) and a tiny Gemma 3 (its first layer, with its own RoPE base),
window 8, prompts up to six windows long. Greedy tokens equal HF's `generate` on both CPU backends and both loops,
with chunked prefill (chunks of 16), again from the radix cache (a cached prefix far longer
than the window), and after retraction. A test checks that the window changes HF's tokens
for these prompts, so a run that ignored it could not pass."""

from __future__ import annotations

import random

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.configs.model_config import ModelConfig, layer_sliding_window
from srt.server_args import ServerArgs
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy
from tests.engine.tiny_models import VOCAB, save_tiny_model

WINDOW = 8
NEW_TOKENS = 24
LENGTHS = [45, 30, 5, 20]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in LENGTHS]


# The layers each tiny model windows (`tiny_models.tiny_config`).
WINDOWED_LAYERS = {
    "mistral": [WINDOW, WINDOW],
    "qwen2-window": [None, WINDOW],
    "gemma2": [WINDOW, None],
    "gemma3": [WINDOW, None],
}


@pytest.fixture(scope="module", params=list(WINDOWED_LAYERS))
def model(request, tmp_path_factory) -> tuple[str, list[list[int]], object]:
    """(folder, HF's greedy tokens of `prompts()`, the HF model, the architecture)."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return str(folder), [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()], hf, request.param


def driver(folder: str, **args) -> InProcessDriver:
    args.setdefault("max_total_tokens", 4096)
    return InProcessDriver(
        ServerArgs(model_path=folder, dtype="float32", skip_tokenizer_init=True, **args)
    )


def check(hf, outs: list[dict], refs: list[list[int]]) -> None:
    for prompt, out, ref in zip(prompts(), outs, refs, strict=True):
        assert_greedy_equal(hf, prompt, out["output_ids"], ref)


def test_the_config_marks_the_windowed_layers(model) -> None:
    folder, _, _, arch = model
    config = ModelConfig.from_path(folder, dtype="float32")
    assert config.sliding_window == WINDOW
    layers = [layer_sliding_window(config.hf_config, i) for i in range(2)]
    assert layers == WINDOWED_LAYERS[arch]


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_equals_hf_chunked_and_cached(model, backend: str, overlap: bool) -> None:
    folder, refs, hf, _ = model
    d = driver(
        folder,
        attention_backend=backend,
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
    )
    check(hf, d.generate(prompts(), GREEDY), refs)
    again = d.generate(prompts(), GREEDY)  # prompts now come from the radix cache
    check(hf, again, refs)
    assert again[0]["meta_info"]["cached_tokens"] > 4 * WINDOW
    if backend == "cpu":  # the compiled kernels ran, not their torch fallback
        assert d.scheduler.worker.model_runner.attn_backend.uses_kernel
    d.scheduler.check_memory()


def test_greedy_equals_hf_after_retraction(model) -> None:
    """Six requests outgrow a 300-token pool (the admission reserve underestimates their
    growth), so some are retracted and recomputed."""
    folder, _, hf, _ = model
    rng = random.Random(4)
    batch = [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in (30, 40, 35, 45, 32, 38)]
    params = {**GREEDY, "max_new_tokens": 48}
    d = driver(folder, max_total_tokens=300, disable_overlap_schedule=True)
    outs = d.generate(batch, params)
    assert d.scheduler.decode.num_retracted_reqs > 0
    for prompt, out in zip(batch, outs, strict=True):
        assert_greedy_equal(hf, prompt, out["output_ids"], hf_greedy(hf, prompt, 48))


def test_the_window_changes_hf_tokens(model) -> None:
    """With a window wider than the sequences, HF's own model gives other tokens for these
    prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, refs, _, _ = model
    config = AutoConfig.from_pretrained(folder)
    config.sliding_window = 4096  # wider than every sequence: the same layers, no window
    full = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    assert hf_greedy(full.eval(), prompts()[0], NEW_TOKENS) != refs[0]
