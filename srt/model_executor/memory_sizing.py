"""How many tokens the KV pool gets.

- `--max-total-tokens` wins when given.
- GPU: `--mem-fraction-static` (default 0.88) of the device's total memory is the static
  budget for everything resident (CUDA context, weights, workspaces), the profiled
  activation peak of the largest prefill batch plus the sampler's logits copies, what is
  allocated after the sizing (the `req_to_token` table, exactly, and the decode CUDA graphs,
  an estimate), and the KV pool, which gets what is left of it (`kv_pool_tokens`). The
  other (1 - fraction) is headroom for the allocator's fragmentation and other processes.
- CPU: the fraction (default 0.3) of the currently available RAM, divided by the KV bytes
  of one token.

The arithmetic is in pure functions so it is unit-tested without a GPU; only
`profile_activation_peak` touches the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from attention.registry import AttentionBackend
    from srt.configs.model_config import ModelConfig

CPU_DEFAULT_MEM_FRACTION = 0.3
GPU_DEFAULT_MEM_FRACTION = 0.88
# The sampler holds about this many float32 [batch, vocab] tensors at once (logits,
# processed logits, probabilities).
SAMPLER_LOGITS_COPIES = 3
# `req_to_token` has a few columns past the context length (ReqToTokenPool's width).
REQ_TO_TOKEN_EXTRA_COLUMNS = 4
# Decode CUDA graphs: their private memory pool holds the intermediates of the largest
# captured batch (every smaller graph reuses it), plus small per-request input buffers.
# SGLang reserves 2 MB per unit of --cuda-graph-max-bs for this when it picks its default
# mem_fraction_static; that per-batch-size estimate is used here until one is measured.
CUDA_GRAPH_BYTES_PER_BATCH = 2 * 2**20


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return (
        2
        * model_config.num_hidden_layers
        * model_config.num_key_value_heads
        * (model_config.head_dim * elem)
    )


def default_mem_fraction(device: str) -> float:
    return GPU_DEFAULT_MEM_FRACTION if device.startswith("cuda") else CPU_DEFAULT_MEM_FRACTION


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_pool_tokens(
    total_bytes: int,
    used_after_weights: int,
    activation_peak: int,
    fraction: float,
    bytes_per_token: int,
    allocated_later: int = 0,
) -> int:
    """KV tokens that fit in `fraction` of the device once weights and activations are in.

    `used_after_weights` is everything resident after loading (total - free: the context,
    the weights, workspaces, other processes); `activation_peak` the profiled peak of a
    forward plus the sampler's reserve; `allocated_later` what is allocated after the pool is
    sized and stays resident (`req_to_token_bytes` + `cuda_graph_reserve_bytes`): the
    measured free memory cannot include it yet. Never negative.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {fraction}")
    budget = int(total_bytes * fraction) - used_after_weights - activation_peak - allocated_later
    return max(budget, 0) // bytes_per_token


def req_to_token_columns(context_len: int) -> int:
    """The width of `req_to_token` for a model of `context_len` tokens."""
    return context_len + REQ_TO_TOKEN_EXTRA_COLUMNS


def req_to_token_bytes(max_running_requests: int, columns: int) -> int:
    """`int32[max_running_requests, columns]`: one row per running request (no spare row;
    CUDA-graph padding reuses row 0)."""
    return 4 * max_running_requests * columns


def cuda_graph_reserve_bytes(max_bs: int, columns: int, page_size: int) -> int:
    """Memory the decode CUDA graphs keep once captured up to batch size `max_bs` (0: none).

    The graph pool and input buffers are an estimate (`CUDA_GRAPH_BYTES_PER_BATCH` per
    batch size); the paged attention backends' persistent page-table buffers are exact:
    int32 page indices [max_bs * pages per request], indptr [max_bs + 1] and last-page
    lengths [max_bs]."""
    if max_bs < 1:
        return 0
    max_pages = -(-columns // page_size)
    page_table = 4 * (max_bs * max_pages + (max_bs + 1) + max_bs)
    return CUDA_GRAPH_BYTES_PER_BATCH * max_bs + page_table


def round_pool_size(size: int, page_size: int) -> int:
    """Down to whole pages; at least two pages, or a clear error."""
    size = size // page_size * page_size
    if size < page_size * 2:
        raise ValueError(
            f"KV pool of {size} tokens is too small; raise --mem-fraction-static or give "
            "--max-total-tokens"
        )
    return size


def pool_size_tokens(
    model_config: ModelConfig,
    max_total_tokens: int | None,
    mem_fraction: float | None,
    page_size: int,
    device: str,
    free_bytes: int,
) -> int:
    """The override, or the fraction of `free_bytes` (the CPU rule), in whole pages."""
    if max_total_tokens is not None:
        return round_pool_size(max_total_tokens, page_size)
    fraction = default_mem_fraction(device) if mem_fraction is None else mem_fraction
    size = int(free_bytes * fraction) // kv_bytes_per_token(model_config, model_config.dtype)
    return round_pool_size(size, page_size)


def sampler_reserve_bytes(max_running_requests: int, vocab_size: int) -> int:
    return SAMPLER_LOGITS_COPIES * max_running_requests * vocab_size * 4


def profile_lens(num_tokens: int, max_len: int) -> list[int]:
    """Split `num_tokens` into requests of at most `max_len` tokens (the largest first)."""
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


def build_profile_batch(
    lens: list[int], page_size: int, model_config: ModelConfig, device: str
) -> ForwardBatch:
    """A fresh-prompt EXTEND batch of `lens` over temporary pools sized for exactly it."""
    pages = [-(-n // page_size) for n in lens]
    req_pool = ReqToTokenPool(len(lens), max(lens) + 1, device)
    kv_pool = MHATokenToKVPool(
        sum(pages) * page_size,
        page_size,
        model_config.dtype,
        model_config.num_key_value_heads,
        model_config.head_dim,
        model_config.num_hidden_layers,
        device,
    )
    slots, positions = [], []
    first_slot = page_size  # page 0 is the dummy
    for row, (n, p) in enumerate(zip(lens, pages, strict=True)):
        row_slots = torch.arange(first_slot, first_slot + n, dtype=torch.int32, device=device)
        req_pool.req_to_token[row, :n] = row_slots
        slots.append(row_slots.long())
        positions.append(torch.arange(n, device=device))
        first_slot += p * page_size

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        input_ids=torch.zeros(sum(lens), dtype=torch.int64, device=device),
        positions=torch.cat(positions),
        out_cache_loc=torch.cat(slots),
        req_pool_indices=torch.arange(len(lens), device=device),
        seq_lens=i64(lens),
        seq_lens_cpu=list(lens),
        extend_prefix_lens=i64([0] * len(lens)),
        extend_seq_lens=i64(lens),
        extend_prefix_lens_cpu=[0] * len(lens),
        extend_seq_lens_cpu=list(lens),
        logits_indices=torch.cumsum(i64(lens), 0) - 1,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )


def profile_activation_peak(
    model: torch.nn.Module, attn_backend: AttentionBackend, forward_batch: ForwardBatch
) -> int:
    """Peak bytes allocated by one forward of `forward_batch` beyond what was resident
    before it (the batch's temporary pools included); 0 off CUDA, where it is not measured."""
    measure = forward_batch.input_ids.is_cuda
    if measure:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    forward_batch.attn_backend = attn_backend
    with torch.inference_mode():
        attn_backend.init_forward_metadata(forward_batch)
        model(forward_batch.input_ids, forward_batch.positions, forward_batch)
    if not measure:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
