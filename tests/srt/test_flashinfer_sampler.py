"""`--sampling-backend`: seeded stays the default; FlashInfer's kernels are opt-in, CUDA only."""

from __future__ import annotations

import pytest
import torch

from srt.model_executor.flashinfer_sampler import FlashInferSampler
from srt.sampling.registry import make_sampler
from srt.sampling.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams


def test_make_sampler_choices() -> None:
    assert type(make_sampler("seeded", "cuda")) is Sampler
    assert type(make_sampler("flashinfer", "cpu")) is Sampler  # no CUDA: seeded, with a warning
    with pytest.raises(ValueError):
        make_sampler("nope", "cpu")


def test_flashinfer_sampler_falls_back_to_seeded_draw_on_cpu() -> None:
    class R:
        def __init__(self, params: SamplingParams, seed: int) -> None:
            self.sampling_params = params
            self.sampling_seed = seed
            self.origin_input_ids: list[int] = [1, 2]
            self.output_ids: list[int] = []

    params = []
    for kw in ({"temperature": 0.7, "top_k": 5}, {"temperature": 1.0, "top_p": 0.8}, {}):
        p = SamplingParams.from_dict(kw)
        p.normalize()
        params.append(p)
    info = SamplingBatchInfo.from_reqs(
        [R(p, i) for i, p in enumerate(params)], 64, "cpu", output_lens=[0, 3, 1]
    )
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    seeded = Sampler().forward(logits, info).next_token_ids
    fused = FlashInferSampler().forward(logits, info).next_token_ids
    assert torch.equal(seeded, fused)
