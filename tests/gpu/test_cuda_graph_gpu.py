"""Real CUDA graphs and real FlashInfer: replayed decode logits equal eager ones."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config

from srt.model_executor.cuda_graph_runner import CudaGraphCapture
from tests.srt.test_cuda_graph_runner import check_replay_matches_eager
from tests.srt.test_models import TINY

pytestmark = pytest.mark.gpu

# FlashInfer's kernels want head_dim 64 / 128 (the CPU tests use 16).
GPU_CONFIGS = {
    "llama_hd64": LlamaConfig(**(TINY | {"hidden_size": 256})),
    "qwen3_hd128_gqa4": Qwen3Config(
        **(TINY | {"num_attention_heads": 8, "num_key_value_heads": 2}),
        head_dim=128,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("config_name", sorted(GPU_CONFIGS))
def test_cuda_graph_replay_matches_eager(page_size: int, config_name: str) -> None:
    check_replay_matches_eager(
        GPU_CONFIGS[config_name], page_size, "cuda", CudaGraphCapture("cuda")
    )
