"""`ModelRunner`: the model, its KV pools, the attention backend, the sampler, and the
decode CUDA graphs.

On CPU the matmul weights are prepacked (panels, and oneDNN or MKL) right after loading
(`srt/layers/cpu_packed.py`; `--disable-cpu-weight-prepack` turns it off), and the norms, the
gated activation and RoPE get the compiled CPU layer ops (`fused_kernels.enable_cpu_ops`;
`--disable-cpu-fused-ops` turns it off); with both, a Llama-family model's decode
steps run one compiled call per decoder layer (`cpu_decode_layer_runner.py`;
`--disable-cpu-fused-decode` turns that off).

Construction order matters on a GPU: the weights load, then the attention backend (its
workspace is resident memory too), then the KV pool is sized from what is left
(`memory_sizing`: `--max-total-tokens`, else `--mem-fraction-static` of the device minus
everything resident and a profiled activation peak; on CPU a fraction of free RAM), then
the decode graphs are captured (CUDA, a backend that supports them, no
`--disable-cuda-graph`). `forward` replays a graph for DECODE batches that fit one and runs
eagerly otherwise.

Tensor parallelism (`tp`, this rank's `TPGroup`): the model holds this rank's shard, so
everything sized by attention heads (the attention backend, the KV pool and its sizing, the
profiled forward) reads `local_config`, the model config with this rank's head counts
(`head_layout`). Each rank sizes its pool from its own memory, then all take the smallest
size (`TPGroup.agree_min`), so their allocators and radix trees stay identical. On CPU, the
ranks of one machine share its RAM: each takes `1 / local ranks` of the fraction. Decode
CUDA graphs are off when tp > 1 (capturing NCCL collectives is not done yet).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from attention.registry import (
    attention_layers,
    create_attention_backend,
    resolve_attention_backend,
)
from mem_cache.allocator import TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.configs.model_config import ModelConfig
from srt.distributed import TPGroup, head_layout
from srt.layers.cpu_packed import prepack_cpu_weights
from srt.layers.fused_kernels import enable_cpu_ops
from srt.layers.pooler import pool_parts, pooled_rows
from srt.layers.quantization import resolve_quantization, weight_bytes
from srt.model_executor.cpu_decode_layer_runner import enable_fused_decode
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.memory_sizing import (
    CPU_DEFAULT_MEM_FRACTION,
    GPU_DEFAULT_MEM_FRACTION,
    available_memory_bytes,
    build_profile_batch,
    cuda_graph_reserve_bytes,
    default_mem_fraction,
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
from srt.model_executor.step_inputs import GraphInputs, StepStager
from srt.model_loader.gguf_quant import gguf_source
from srt.model_loader.loader import get_model
from srt.sampling.registry import make_sampler
from srt.server_args import ServerArgs
from srt.utils.device_memory import device_memory

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 512
GIB = 2**30

__all__ = [
    "CPU_DEFAULT_MEM_FRACTION",
    "GPU_DEFAULT_MEM_FRACTION",
    "ModelRunner",
    "available_memory_bytes",
    "kv_bytes_per_token",
]


def local_model_config(model_config: ModelConfig, tp: TPGroup) -> ModelConfig:
    """`model_config` with this rank's attention head counts (itself at tp=1). A model whose
    heads cannot be split over the ranks is a ValueError from `head_layout`."""
    if tp.size == 1:
        return model_config
    layout = head_layout(
        model_config.num_attention_heads, model_config.num_key_value_heads, tp.size, tp.rank
    )
    return dataclasses.replace(
        model_config,
        num_attention_heads=layout.num_heads,
        num_key_value_heads=layout.num_kv_heads,
    )


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, server_args: ServerArgs, tp: TPGroup | None = None
    ) -> None:
        self.tp = tp or TPGroup.single()
        self.model_config = model_config
        self.local_config = local_model_config(model_config, self.tp)
        self.server_args = server_args
        self.device = server_args.resolved_device()
        torch.manual_seed(server_args.random_seed)
        self.quantization = resolve_quantization(
            server_args.quantization, gguf_source(model_config.model_path) is not None, self.device
        )
        self.model = get_model(
            model_config,
            server_args.load_format,
            self.device,
            self.tp,
            server_args.is_embedding,
            self.quantization,
        )
        sizes = weight_bytes(self.model)
        logger.info(
            "Weights: %.1f MB (%s)",
            sum(sizes.values()) / 1e6,
            ", ".join(f"{kind} {n / 1e6:.1f} MB" for kind, n in sorted(sizes.items())),
        )
        if self.device == "cpu" and not server_args.disable_cpu_weight_prepack:
            prepack_cpu_weights(self.model)  # before the KV pool takes its share of free RAM
        if self.device == "cpu" and not server_args.disable_cpu_fused_ops:
            enable_cpu_ops(self.model)
            if not server_args.disable_cpu_fused_decode:
                enable_fused_decode(self.model)  # needs the packed panels and the layer ops
        self.attn_backend_name = resolve_attention_backend(
            server_args.attention_backend,
            self.device,
            model_config.dtype,
            model_config.sliding_window,
        )
        self.attn_backend = create_attention_backend(
            self.attn_backend_name,
            num_heads=self.local_config.num_attention_heads,
            num_kv_heads=self.local_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=model_config.dtype,
            device=self.device,
            page_size=server_args.page_size,
            sliding_window=model_config.sliding_window,
            layers=attention_layers(self.model),
        )
        self.init_memory_pool()
        self.sampler = make_sampler(server_args.sampling_backend, self.device)
        self.memory = device_memory(self.device)
        graph_bs = self._graph_max_bs() if self.device.startswith("cuda") else 0
        graph_inputs = GraphInputs(graph_bs, self.memory) if graph_bs else None
        self.stager = StepStager(self.memory, graph_inputs)
        self.cuda_graph_runner = self.init_cuda_graphs(graph_inputs)

    def init_memory_pool(self) -> None:
        cfg, args = self.local_config, self.server_args
        max_reqs_bound = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        if self.device.startswith("cuda") and args.max_total_tokens is None:
            tokens = self._profiled_pool_tokens(max_reqs_bound)
        else:
            free = 0
            if args.max_total_tokens is None:
                # The ranks on this machine share its RAM (on GPUs each rank has a device of
                # its own and is sized by the profiled branch above).
                free = available_memory_bytes(self.device) // self.local_ranks()
            tokens = pool_size_tokens(
                cfg,
                args.max_total_tokens,
                args.mem_fraction_static,
                args.page_size,
                self.device,
                free,
            )
        # Ranks measured their memory at different moments; they must hold the same pool,
        # or their allocators (and so their batches) would diverge. A control-group op: this
        # runs on the scheduler thread, before any forward thread exists.
        self.max_total_tokens = self.tp.agree_min(tokens)
        max_reqs = args.max_running_requests or min(
            DEFAULT_MAX_RUNNING_REQUESTS, max(self.max_total_tokens // 2, 1)
        )
        self.max_running_requests = max_reqs
        self.req_to_token_pool = ReqToTokenPool(
            max_reqs, req_to_token_columns(cfg.context_len), self.device
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_tokens,
            args.page_size,
            cfg.dtype,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            self.device,
        )
        # Slots are bookkeeping: they stay on the host and reach the device staged with the
        # batch that writes them (step_inputs.py).
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, args.page_size, "cpu")
        logger.info(
            "KV pool: %d tokens (%.2f GiB, %s), max running requests %d, page size %d, "
            "attention backend %s%s",
            self.max_total_tokens,
            self.token_to_kv_pool.get_kv_size_bytes() / GIB,
            cfg.dtype,
            max_reqs,
            args.page_size,
            self.attn_backend_name,
            self._tp_note(tokens),
        )

    def local_ranks(self) -> int:
        """The tensor-parallel ranks on this machine: every node runs the same number
        (`ServerArgs` checks that tp size is a multiple of --nnodes)."""
        return max(1, self.tp.size // self.server_args.nnodes)

    def _tp_note(self, own_tokens: int) -> str:
        if self.tp.size == 1:
            return ""
        cfg = self.local_config
        return (
            f", TP rank {self.tp.rank} of {self.tp.size} ({cfg.num_attention_heads} q / "
            f"{cfg.num_key_value_heads} KV heads here; this rank alone could hold "
            f"{own_tokens} tokens)"
        )

    def _profiled_pool_tokens(self, max_reqs: int) -> int:
        """GPU: size the pool from the device's memory after weights and a profiled peak."""
        cfg, args = self.local_config, self.server_args
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        num_tokens = max(args.prefill_token_budget(), args.chunk_size or 0)
        batch = build_profile_batch(
            profile_lens(num_tokens, cfg.context_len), args.page_size, cfg, self.device
        )
        peak = profile_activation_peak(self.model, self.attn_backend, batch)
        del batch
        torch.cuda.empty_cache()
        reserve = sampler_reserve_bytes(max_reqs, cfg.vocab_size)
        fraction = args.mem_fraction_static
        if fraction is None:
            fraction = default_mem_fraction(self.device)
        # Allocated after the sizing, so not in `used`: the request table (at its largest,
        # max_reqs rows) and the decode graphs, when init_cuda_graphs will capture them.
        columns = req_to_token_columns(cfg.context_len)
        graphs = self._graphs_possible()
        graph_bs = min(args.cuda_graph_max_bs, max_reqs) if graphs else 0
        table = req_to_token_bytes(max_reqs, columns)
        graph_mem = cuda_graph_reserve_bytes(graph_bs, columns, args.page_size)
        tokens = kv_pool_tokens(
            total,
            used,
            peak + reserve,
            fraction,
            kv_bytes_per_token(cfg, cfg.dtype),
            allocated_later=table + graph_mem,
        )
        logger.info(
            "GPU memory: %.2f GiB total, %.2f GiB in use after weights, activation peak "
            "%.2f GiB (%d-token prefill) + sampler %.2f GiB, req_to_token %.2f GiB, CUDA "
            "graphs (bs <= %d) %.2f GiB, mem_fraction_static %.2f -> #kv-pool-tokens %d",
            total / GIB,
            used / GIB,
            peak / GIB,
            num_tokens,
            reserve / GIB,
            table / GIB,
            graph_bs,
            graph_mem / GIB,
            fraction,
            tokens,
        )
        return round_pool_size(tokens, args.page_size)

    def _graphs_possible(self) -> bool:
        return (
            not self.server_args.disable_cuda_graph
            and not self.server_args.is_embedding  # graphs are for decode, which it never runs
            and self.attn_backend.supports_cuda_graph
            and self.tp.size == 1
            and self.uncapturable_layer() is None
        )

    def uncapturable_layer(self) -> str | None:
        """The class name of a model layer that cannot run inside a CUDA graph, if any."""
        for module in self.model.modules():
            if not getattr(module, "cuda_graph_capturable", True):
                return type(module).__name__
        return None

    def _graph_max_bs(self) -> int:
        """The largest decode batch a graph is captured for (0: no graphs)."""
        if not self._graphs_possible():
            return 0
        return max(min(self.server_args.cuda_graph_max_bs, self.max_running_requests), 0)

    def init_cuda_graphs(self, graph_inputs: GraphInputs | None) -> CudaGraphRunner | None:
        args = self.server_args
        if not self.device.startswith("cuda") or args.disable_cuda_graph or args.is_embedding:
            return None
        if not self.attn_backend.supports_cuda_graph:
            logger.info("Decode CUDA graphs off: %s cannot be captured", self.attn_backend_name)
            return None
        if self.tp.size > 1:
            logger.info(
                "Decode CUDA graphs off: tp size %d (capturing the NCCL all-reduces is not "
                "supported yet)",
                self.tp.size,
            )
            return None
        uncapturable = self.uncapturable_layer()
        if uncapturable is not None:
            logger.info(
                "Decode CUDA graphs off: the model's %s layers read sizes on the host",
                uncapturable,
            )
            return None
        if graph_inputs is None:
            return None
        return CudaGraphRunner(
            self.model,
            self.attn_backend,
            self.req_to_token_pool,
            self.token_to_kv_pool,
            graph_inputs,
        )

    def graph_batch_size(self, bs: int) -> int | None:
        """The padded size of the graph a decode batch of `bs` replays (None: eager)."""
        graphs = self.cuda_graph_runner
        return None if graphs is None else graphs.bucket(bs)

    def _bind(self, forward_batch: ForwardBatch) -> None:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits, float32, at `forward_batch.logits_indices`."""
        self._bind(forward_batch)
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(forward_batch):
            return graphs.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def forward_pooled(self, forward_batch: ForwardBatch, method: str) -> torch.Tensor:
        """An embedding server's extend: each request's pooling part, float32 [N, hidden]
        (`srt/layers/pooler.py`)."""
        self._bind(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        keep = pooled_rows(method, forward_batch)
        hidden = self.model.hidden_states(
            forward_batch.input_ids, forward_batch.positions, forward_batch, keep
        )
        return pool_parts(method, hidden, forward_batch)
