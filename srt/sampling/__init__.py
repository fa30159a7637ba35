"""Sampling: per-request parameters, their batched tensor form, and the sampler."""

from srt.sampling.sampler import (
    SampleOutput,
    Sampler,
    get_token_logprobs,
    get_top_logprobs,
    top_k_top_p_min_p_filter,
)
from srt.sampling.sampling_batch_info import ReqLike, SamplingBatchInfo
from srt.sampling.sampling_params import SAMPLING_EPS, SamplingParams

__all__ = [
    "SAMPLING_EPS",
    "ReqLike",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "get_token_logprobs",
    "get_top_logprobs",
    "top_k_top_p_min_p_filter",
]
