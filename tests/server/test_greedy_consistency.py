"""Greedy output over HTTP equals the in-process scheduler's and HF transformers' (float32,
default model, with the engine-core near-tie rule)."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.engine.hf_reference import DefaultModelReference
from tests.engine.shared_worker import driver_on

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# A subset of `DEFAULT_TEXTS`, whose HF tokens the session computes once.
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Photosynthesis is the process by which plants",
]


def test_http_equals_inprocess_and_hf(
    url: str, default_worker: Any, default_hf_reference: DefaultModelReference
) -> None:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = requests.post(
        url + "/generate", json={"text": TEXTS, "sampling_params": params}, timeout=300
    )
    assert r.status_code == 200, r.text
    http = [o["output_ids"] for o in r.json()]

    with driver_on(default_worker, max_total_tokens=8192) as driver:
        prompts = [driver.tokenizer.encode(t) for t in TEXTS]
        local = [o["output_ids"] for o in driver.generate(prompts, params)]
    assert http == local

    assert prompts == [default_hf_reference.prompts[t] for t in TEXTS]
    for text, out in zip(TEXTS, http, strict=True):
        default_hf_reference.assert_greedy_equal(text, out)
