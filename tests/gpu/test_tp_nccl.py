"""Tensor parallelism over NCCL: two ranks, one GPU each (`TPRanks(2, backend="nccl")`;
`init_tp_group` makes rank r's current device cuda:r). Greedy tokens of a tiny float32 model
at tp=2 equal tp=1's on cuda:0, up to a near-tie of tp=1's logits, in both loops; every rank
took rank 0's ids and sampled the same ones itself. Skipped without two GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from srt.distributed import TPGroup
from tests.distributed.test_tp_greedy import assert_tp_greedy_equal, generate, rand_prompts
from tests.distributed.tp_harness import TPRanks
from tests.engine.tiny_models import VOCAB, save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module")
def nccl2() -> Iterator[TPRanks]:
    ranks = TPRanks(2, backend="nccl")
    yield ranks
    ranks.close()


def _device_of(tp: TPGroup) -> int:
    return torch.cuda.current_device()


def test_each_rank_has_its_own_gpu(nccl2: TPRanks) -> None:
    assert nccl2.run(_device_of) == [0, 1]


@pytest.mark.parametrize("overlap", [True, False])
def test_tp2_greedy_equals_tp1(nccl2: TPRanks, tmp_path: Path, overlap: bool) -> None:
    path = str(save_tiny_model("qwen2", tmp_path / "qwen2"))
    prompts = rand_prompts([5, 23, 41, 70], VOCAB, seed=3)
    args = {
        "device": "cuda",
        "chunked_prefill_size": 16,
        "max_total_tokens": 4096,
        "disable_overlap_schedule": not overlap,
    }
    ref = generate(TPGroup.single(), path, prompts, 24, **args)
    ranks = nccl2.run(generate, path, prompts, 24, **args)
    assert_tp_greedy_equal(ref, ranks)
