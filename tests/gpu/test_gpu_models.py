"""The new architectures on the GPU path: FlashInfer planned with each layer's window and
soft cap (Mistral, Qwen2 with windows, Gemma 2 and 3), CUDA graphs on, against torch_native
on the same device; the MoE models' expert path with graphs off (its group sizes are read
on the host)."""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import VOCAB, save_tiny_model
from tests.gpu.test_gpu_engine import assert_same_greedy, driver, greedy, w1_prompts

pytestmark = pytest.mark.gpu

ARCHS = ["mistral", "qwen2-window", "gemma2", "gemma3", "qwen3-moe"]


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
        graphs = runner.cuda_graph_runner
        assert (graphs is None) == (arch == "qwen3-moe")
        if arch != "qwen3-moe":  # the graphs re-plan every variant on the fast path
            assert set(runner.attn_backend.graphs.paths.values()) == {"fast"}
        variants = runner.attn_backend.variants
        assert len(variants) == {"mistral": 1, "qwen3-moe": 1}.get(arch, 2)
        ours = greedy(d, prompts)
    for out, ref in zip(ours, refs, strict=True):
        assert_same_greedy(out["output_ids"], ref)
