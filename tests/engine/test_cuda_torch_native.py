"""torch_native on CUDA: the same greedy equality with HF as on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy
from tests.engine.test_greedy_vs_hf import NEW_TOKENS, mixed_prompts
from tests.engine.tiny_models import VOCAB, save_tiny_model

pytestmark = pytest.mark.gpu


# Every architecture: the windowed and soft-capped ones, LongRoPE, and the MoE expert path's
# GEMMs on the device.
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "qwen2-window", "gemma2", "gemma3", "phi3"]
ARCHS += ["qwen3-moe", "mixtral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_native_cuda_greedy_equal_hf(arch: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(arch, tmp_path)
    args = ServerArgs(
        model_path=str(folder),
        dtype="float32",
        device="cuda",
        skip_tokenizer_init=True,
        max_total_tokens=8192,
        attention_backend="torch_native",
    )
    driver = InProcessDriver(args)
    # Phi-3's prompts stay below its original context (128) with their new tokens: past it
    # HF re-encodes every position with the long factors (tests/engine/test_longrope.py).
    prompts = mixed_prompts(3 if arch == "phi3" else 8, VOCAB)
    outs = driver.generate(
        prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    )
    # HF's eager attention is its reference: its SDPA path drops Gemma 2's score soft-capping
    # in some transformers releases (the GPU machine's 5.17 ran Gemma 2 without it).
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(hf, prompt, out["output_ids"], hf_greedy(hf, prompt, NEW_TOKENS))
    driver.scheduler.check_memory()
