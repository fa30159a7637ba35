"""The windowed and soft-capped architectures on the GPU path: FlashInfer planned with each
layer's window and soft cap (Mistral, Qwen2 with windows, Gemma 2 and 3), CUDA graphs on,
against torch_native on the same device. (The MoE models' expert path on CUDA is checked
against HF in tests/engine/test_cuda_torch_native.py.)"""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import VOCAB, save_tiny_model
from tests.gpu.test_gpu_engine import assert_same_greedy, driver, greedy, w1_prompts

pytestmark = pytest.mark.gpu

ARCHS = ["mistral", "qwen2-window", "gemma2", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_flashinfer_greedy_equals_torch_native(arch: str, tmp_path) -> None:
    folder = str(save_tiny_model(arch, tmp_path))
    # Prompts from 3 to 120 tokens and 48 new ones: far past the tiny models' window of 8.
    prompts = w1_prompts(12, 3, 120, VOCAB, seed=2)
    prompts += [prompts[0][:60] + p[:10] for p in prompts[:3]]  # cached shared prefixes
    with driver(model_path=folder, attention_backend="torch_native") as d:
        refs = greedy(d, prompts, logprobs=True)
    with driver(model_path=folder, attention_backend="flashinfer", page_size=16) as d:
        runner = d.worker.model_runner
        assert runner.cuda_graph_runner is not None
        # The graphs re-plan every variant on the fast path.
        assert set(runner.attn_backend.graphs.paths.values()) == {"fast"}
        assert len(runner.attn_backend.variants) == (1 if arch == "mistral" else 2)
        ours = greedy(d, prompts)
    for out, ref in zip(ours, refs, strict=True):
        assert_same_greedy(out["output_ids"], ref)
