"""KV pool sizing arithmetic, and the activation-profile batch, without a GPU."""

from __future__ import annotations

import pytest
import torch

from attention.torch_native_backend import TorchNativeAttnBackend
from srt.model_executor.memory_sizing import (
    build_profile_batch,
    kv_bytes_per_token,
    kv_pool_tokens,
    pool_size_tokens,
    profile_activation_peak,
    profile_lens,
    round_pool_size,
    sampler_reserve_bytes,
)
from tests.srt.test_models import CONFIGS, build_pair

GIB = 2**30


class FakeConfig:
    num_hidden_layers = 30
    num_key_value_heads = 3
    head_dim = 64
    dtype = torch.bfloat16


def test_kv_pool_tokens_arithmetic() -> None:
    # 80 GiB device, 0.88 static: 70.4 GiB; 2 GiB resident, 3 GiB activations -> 65.4 GiB.
    per_token = kv_bytes_per_token(FakeConfig(), torch.bfloat16)
    assert per_token == 2 * 30 * 3 * 64 * 2
    tokens = kv_pool_tokens(80 * GIB, 2 * GIB, 3 * GIB, 0.88, per_token)
    assert tokens == (int(80 * GIB * 0.88) - 5 * GIB) // per_token
    assert kv_pool_tokens(1000, 100, 200, 1.0, 7) == 700 // 7
    # Exact division and an off-by-one byte.
    assert kv_pool_tokens(1000, 0, 0, 1.0, 10) == 100
    assert kv_pool_tokens(1000, 1, 0, 1.0, 10) == 99


def test_kv_pool_tokens_monotone_and_never_negative() -> None:
    base = kv_pool_tokens(80 * GIB, 2 * GIB, GIB, 0.8, 4096)
    assert kv_pool_tokens(80 * GIB, 2 * GIB, 2 * GIB, 0.8, 4096) < base  # more activations
    assert kv_pool_tokens(80 * GIB, 2 * GIB, GIB, 0.9, 4096) > base  # larger fraction
    assert kv_pool_tokens(80 * GIB, 70 * GIB, 10 * GIB, 0.5, 4096) == 0  # over budget
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="mem_fraction_static"):
            kv_pool_tokens(GIB, 0, 0, bad, 1)


def test_round_pool_size() -> None:
    assert round_pool_size(1000, 16) == 992
    assert round_pool_size(1000, 1) == 1000
    with pytest.raises(ValueError, match="too small"):
        round_pool_size(31, 16)


def test_pool_size_tokens_override_and_cpu_fraction() -> None:
    cfg = FakeConfig()
    per_token = kv_bytes_per_token(cfg, cfg.dtype)
    assert pool_size_tokens(cfg, 1000, None, 16, "cuda", 0) == 992  # the override wins
    free = 10 * GIB
    assert pool_size_tokens(cfg, None, 0.5, 1, "cpu", free) == int(free * 0.5) // per_token
    assert pool_size_tokens(cfg, None, None, 1, "cpu", free) == int(free * 0.3) // per_token


def test_sampler_reserve() -> None:
    assert sampler_reserve_bytes(512, 151936) == 3 * 512 * 151936 * 4


def test_profile_lens() -> None:
    assert profile_lens(16384, 8192) == [8192, 8192]
    assert profile_lens(16384, 6000) == [6000, 6000, 4384]
    assert profile_lens(100, 2048) == [100]


@pytest.mark.parametrize("page_size", [1, 16])
def test_profile_batch_runs_a_forward(page_size: int) -> None:
    config = CONFIGS["llama"]
    _, model = build_pair(config)

    class Cfg:
        dtype = torch.float32
        num_key_value_heads = config.num_key_value_heads
        head_dim = config.hidden_size // config.num_attention_heads
        num_hidden_layers = config.num_hidden_layers

    lens = profile_lens(70, 40)
    batch = build_profile_batch(lens, page_size, Cfg(), "cpu")
    assert batch.batch_size == 2 and batch.input_ids.numel() == 70
    slots = batch.out_cache_loc.tolist()
    assert len(set(slots)) == 70 and min(slots) >= page_size  # never the dummy page
    first = batch.req_to_token_pool.req_to_token[:, 0].tolist()
    assert all(s % page_size == 0 for s in first)  # requests start on a page
    assert batch.logits_indices.tolist() == [39, 69]
    assert profile_activation_peak(model, TorchNativeAttnBackend(), batch) == 0  # CPU
    written = batch.token_to_kv_pool.get_key_buffer(0)[batch.out_cache_loc]
    assert written.abs().sum() > 0  # the forward ran and saved its KV
