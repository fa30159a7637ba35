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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
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
    prompts = mixed_prompts(8, VOCAB)
    outs = driver.generate(
        prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(hf, prompt, out["output_ids"], hf_greedy(hf, prompt, NEW_TOKENS))
    driver.scheduler.check_memory()
