"""`ModelRunner`: the model, its KV pools, the attention backend and the sampler.

Sizing: the KV pool gets `--max-total-tokens` slots when given; otherwise a fraction
(`--mem-fraction-static`) of the memory left after the weights, divided by the bytes one
token's K and V take across all layers.
"""

from __future__ import annotations

import logging
import os

import torch

from attention.registry import create_attention_backend
from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.configs.model_config import ModelConfig
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_loader.loader import get_model
from srt.sampling.sampler import Sampler
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_DEFAULT_MEM_FRACTION = 0.3
GPU_DEFAULT_MEM_FRACTION = 0.88
DEFAULT_MAX_RUNNING_REQUESTS = 512


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return (
        2
        * model_config.num_hidden_layers
        * model_config.num_key_value_heads
        * (model_config.head_dim * elem)
    )


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pool_size_tokens(
    model_config: ModelConfig, server_args: ServerArgs, device: str, free_bytes: int
) -> int:
    """KV pool size in tokens, a multiple of the page size."""
    if server_args.max_total_tokens is not None:
        size = server_args.max_total_tokens
    else:
        fraction = server_args.mem_fraction_static
        if fraction is None:
            fraction = (
                GPU_DEFAULT_MEM_FRACTION if device.startswith("cuda") else CPU_DEFAULT_MEM_FRACTION
            )
        size = int(free_bytes * fraction) // kv_bytes_per_token(model_config, model_config.dtype)
    size = size // server_args.page_size * server_args.page_size
    if size < server_args.page_size * 2:
        raise ValueError(f"KV pool of {size} tokens is too small; raise the memory budget")
    return size


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs) -> None:
        self.model_config = model_config
        self.server_args = server_args
        self.device = server_args.resolved_device()
        torch.manual_seed(server_args.random_seed)
        self.model = get_model(model_config, server_args.load_format, self.device)
        self.init_memory_pool()
        backend = server_args.attention_backend
        if backend == "auto":
            backend = "torch_native"
        self.attn_backend = create_attention_backend(backend)
        self.sampler = Sampler()

    def init_memory_pool(self) -> None:
        cfg, args = self.model_config, self.server_args
        self.max_total_tokens = pool_size_tokens(
            cfg, args, self.device, available_memory_bytes(self.device)
        )
        max_reqs = args.max_running_requests or min(
            DEFAULT_MAX_RUNNING_REQUESTS, max(self.max_total_tokens // 2, 1)
        )
        self.req_to_token_pool = ReqToTokenPool(max_reqs, cfg.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_tokens,
            args.page_size,
            cfg.dtype,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            self.device,
        )
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, args.page_size, self.device)
        logger.info(
            "KV pool: %d tokens (%.2f GiB, %s), max running requests %d, page size %d",
            self.max_total_tokens,
            self.token_to_kv_pool.get_kv_size_bytes() / 2**30,
            cfg.dtype,
            max_reqs,
            args.page_size,
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits, float32, at `forward_batch.logits_indices`."""
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
