"""KV pool sizing arithmetic, and the activation-profile batch, without a GPU."""

from __future__ import annotations

import pytest
import torch

from attention.torch_native_backend import TorchNativeAttnBackend
from mem_cache.memory_pool import ReqToTokenPool
from srt.distributed import TPGroup
from srt.model_executor.memory_sizing import (
    CUDA_GRAPH_BYTES_PER_BATCH,
    build_profile_batch,
    cuda_graph_reserve_bytes,
    kv_bytes_per_token,
    kv_pool_tokens,
    pool_size_tokens,
    profile_activation_peak,
    profile_lens,
    req_to_token_bytes,
    req_to_token_columns,
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


def test_req_to_token_bytes_is_the_table_the_runner_builds() -> None:
    columns = req_to_token_columns(2048)
    assert columns == 2052
    assert req_to_token_bytes(512, columns) == 4 * 512 * 2052  # int32, one row per request
    pool = ReqToTokenPool(7, req_to_token_columns(100))  # what ModelRunner allocates
    table = pool.req_to_token
    assert req_to_token_bytes(7, req_to_token_columns(100)) == table.numel() * table.itemsize


def test_cuda_graph_reserve_bytes() -> None:
    assert cuda_graph_reserve_bytes(0, 4100, 1) == 0  # no graphs captured
    # bs 160, 4100 columns, page 16: 257 pages per request in the page table.
    page_table = 4 * (160 * 257 + 161 + 160)
    assert cuda_graph_reserve_bytes(160, 4100, 16) == 160 * CUDA_GRAPH_BYTES_PER_BATCH + page_table
    assert CUDA_GRAPH_BYTES_PER_BATCH == 2 * 2**20  # SGLang's 2 MB per captured batch size
    assert cuda_graph_reserve_bytes(1, 8, 1) == CUDA_GRAPH_BYTES_PER_BATCH + 4 * (8 + 2 + 1)
    # Larger batches and longer contexts only ever reserve more.
    assert cuda_graph_reserve_bytes(161, 4100, 16) > cuda_graph_reserve_bytes(160, 4100, 16)
    assert cuda_graph_reserve_bytes(160, 8200, 16) > cuda_graph_reserve_bytes(160, 4100, 16)


def test_memory_allocated_after_sizing_leaves_the_pool() -> None:
    """The table and the graphs come out of the KV pool's share, byte for byte."""
    per_token = kv_bytes_per_token(FakeConfig(), torch.bfloat16)
    columns = req_to_token_columns(32768)
    later = req_to_token_bytes(512, columns) + cuda_graph_reserve_bytes(256, columns, 1)
    without = kv_pool_tokens(80 * GIB, 2 * GIB, 3 * GIB, 0.88, per_token)
    with_later = kv_pool_tokens(80 * GIB, 2 * GIB, 3 * GIB, 0.88, per_token, allocated_later=later)
    assert with_later == (int(80 * GIB * 0.88) - 5 * GIB - later) // per_token
    # 512 x 32772 int32 = 64 MiB of table; 256 x 2 MiB + 32 MiB of page table for the graphs.
    assert later == 4 * 512 * 32772 + 256 * 2 * 2**20 + 4 * (256 * 32772 + 257 + 256)
    assert without - with_later >= later // per_token
    assert kv_pool_tokens(GIB, 0, 0, 1.0, 1024, allocated_later=2 * GIB) == 0  # never negative


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


@pytest.mark.parametrize("graphs", [True, False])
def test_runner_sizing_subtracts_table_and_graphs(
    monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """ModelRunner's GPU sizing, with the device calls faked: the pool it picks is what is
    left after the request table and (when they will be captured) the decode graphs."""
    from types import SimpleNamespace

    from srt.model_executor import model_runner as mr

    total, free, peak = 80 * GIB, 70 * GIB, 3 * GIB
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
    monkeypatch.setattr(mr, "build_profile_batch", lambda *a: None)
    monkeypatch.setattr(mr, "profile_activation_peak", lambda *a: peak)
    runner = mr.ModelRunner.__new__(mr.ModelRunner)
    runner.model, runner.device = torch.nn.Linear(1, 1), "cuda"  # no uncapturable layer
    layers = {k: getattr(FakeConfig, k) for k in ("num_hidden_layers", "num_key_value_heads")}
    runner.model_config = SimpleNamespace(
        context_len=8192, vocab_size=32000, dtype=torch.bfloat16, head_dim=64, **layers
    )
    runner.server_args = SimpleNamespace(
        prefill_token_budget=lambda: 8192,
        chunk_size=None,
        mem_fraction_static=0.88,
        page_size=16,
        disable_cuda_graph=not graphs,
        is_embedding=False,
        cuda_graph_max_bs=160,
    )
    runner.local_config = runner.model_config  # tp=1: this rank holds every head
    runner.tp = TPGroup.single()
    runner.attn_backend = SimpleNamespace(supports_cuda_graph=True)
    tokens = runner._profiled_pool_tokens(256)

    columns = 8192 + 4
    later = req_to_token_bytes(256, columns)
    if graphs:
        later += cuda_graph_reserve_bytes(160, columns, 16)
    per_token = kv_bytes_per_token(FakeConfig(), torch.bfloat16)
    activations = peak + sampler_reserve_bytes(256, 32000)
    budget = int(total * 0.88) - (total - free) - activations - later
    assert tokens == budget // per_token // 16 * 16
