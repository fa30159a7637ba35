"""Greedy output over HTTP equals the in-process scheduler's and HF transformers' (float32,
default model, with the engine-core near-tie rule)."""

from __future__ import annotations

import pytest
import requests
import torch

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy_batch

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Photosynthesis is the process by which plants",
]


def test_http_equals_inprocess_and_hf(url: str, default_model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = requests.post(
        url + "/generate", json={"text": TEXTS, "sampling_params": params}, timeout=300
    )
    assert r.status_code == 200, r.text
    http = [o["output_ids"] for o in r.json()]

    driver = InProcessDriver(ServerArgs(dtype="float32", max_total_tokens=8192))
    prompts = [driver.tokenizer.encode(t) for t in TEXTS]
    local = [o["output_ids"] for o in driver.generate(prompts, params)]
    assert http == local

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    refs = hf_greedy_batch(hf, prompts, NEW_TOKENS)
    for prompt, out, ref in zip(prompts, http, refs, strict=True):
        assert_greedy_equal(hf, prompt, out, ref)
