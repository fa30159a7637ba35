"""Greedy output over HTTP equals HF transformers' (float32, default model, with the
engine-core near-tie rule), as the in-process scheduler's does (tests/engine/test_greedy_vs_hf.py,
the same prompts): the server is not given a copy of the model in this process to compare with,
which would load it a second time in the test worker that runs the server's tests."""

from __future__ import annotations

import pytest
import requests

from tests.engine.hf_reference import DefaultModelReference

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


def test_http_equals_hf(url: str, default_hf_reference: DefaultModelReference) -> None:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    prompts = [default_hf_reference.prompts[t] for t in TEXTS]
    r = requests.post(
        url + "/generate", json={"text": TEXTS, "sampling_params": params}, timeout=300
    )
    assert r.status_code == 200, r.text
    http = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in http] == [len(p) for p in prompts]
    for text, out in zip(TEXTS, http, strict=True):
        default_hf_reference.assert_greedy_equal(text, out["output_ids"])
