"""Decode steps of Llama-family models on CPU: one compiled call per decoder layer.

A decode step runs each layer's RMSNorm, QKV matmul, RoPE, KV write, paged attention, o
matmul, residual add + RMSNorm, gate-up matmul, SiLU-and-mul and down matmul through compiled
kernels already (`srt/kernels/`), but one Python module and one ctypes call at a time, and
that Python (module calls, tensor allocation, argument checks, marshalling) is a large part
of a small model's step. `srt/kernels/csrc/decode_layer.c` runs the same kernels in the same
order for a whole layer in one call, so its output equals the modules' bit for bit
(`tests/srt/test_cpu_decode_layer.py`); `python -m bench.bench_one_batch` with and without
`--disable-cpu-fused-decode` measures what it saves.

`enable_fused_decode(model)` (called by ModelRunner after the weights are packed and the CPU
layer ops enabled) attaches a `FusedDecode` to a model whose every layer qualifies: float32
weights, or bfloat16 where the CPU has AVX512_BF16 (the packed panels exist), each of them
packed or kept quantized (`srt/layers/quantization.py`), the compiled
layer ops, no q/k norm (Qwen3), one TP rank. `FusedDecode.run` then takes the decode batches
it can (the cpu attention backend's decode kernel, a pool of the weights' dtype, at most
`SMALL_ROWS` requests, the panels' row limit) and returns None for every other batch, which
runs through the modules. `--disable-cpu-fused-decode` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

import torch

from srt.kernels.attention import SharedPrefixes
from srt.kernels.decode_layer import (
    DecodeLayerArgs,
    DecodeStepArgs,
    decode_layer_error,
    decode_layer_kernel,
)
from srt.layers.cpu_packed import SMALL_ROWS
from srt.models.llama import LlamaDecoderLayer

if TYPE_CHECKING:
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(linear: Any) -> tuple[int | None, int | None]:
    """A linear layer's weight and bias as the kernel reads them: the quantized panels with
    their float32 bias, or the packed panels with the layer's bias."""
    if linear.quant is not None:
        return _ptr(linear.quant.panels), _ptr(linear.quant.bias)
    return _ptr(linear.packed.panels), _ptr(linear.bias)


def _qualifies(layer: Any) -> str | None:
    """Why a decoder layer cannot run fused, or None when it can."""
    if not isinstance(layer, LlamaDecoderLayer):
        return f"{type(layer).__name__} layers (the kernel is the Llama layer)"
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None:
        return "q/k norm"
    if attn.attn.sliding_window is not None:
        return "sliding-window attention"
    if not hasattr(mlp, "gate_up_proj"):
        return "a sparse (mixture-of-experts) MLP"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(m.tp.size != 1 for m in (attn.o_proj, mlp.down_proj)):
        return "tensor parallelism"
    dtype = attn.qkv_proj.weight.dtype
    if dtype not in _DTYPES or any(m.weight.dtype != dtype for m in linears):
        return f"{dtype} weights"
    if any(m.quant is None and (m.packed is None or m.packed.panels is None) for m in linears):
        return f"no packed {dtype} panels (bfloat16 needs AVX512_BF16)"
    ops_users = (layer.input_layernorm, layer.post_attention_layernorm, attn.rotary_emb, mlp.act_fn)
    if any(m.cpu_ops is None for m in ops_users):
        return "no compiled layer ops"
    return None


class FusedDecode:
    """The decoder layers of one model, run one compiled call each for the decode batches
    that qualify (see the module docstring)."""

    def __init__(self, kernel: Any, layers: list[Any]) -> None:
        self._kernel = kernel
        self._layers = layers
        self._dtype = layers[0].self_attn.qkv_proj.weight.dtype
        self._args: list[DecodeLayerArgs] = []
        self._pool: Any = None  # the KV pool the layer arguments point into

    def _layer_args(self, pool: Any) -> list[DecodeLayerArgs]:
        """Per-layer arguments, built once per KV pool (they hold its buffers' addresses)."""
        if pool is self._pool:
            return self._args
        args = []
        for i, layer in enumerate(self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            rope = attn.rotary_emb
            k_cache, v_cache = pool.get_kv_buffer(i)
            args.append(
                DecodeLayerArgs(
                    _ptr(layer.input_layernorm.weight),
                    _ptr(layer.post_attention_layernorm.weight),
                    layer.input_layernorm.variance_epsilon,
                    layer.post_attention_layernorm.variance_epsilon,
                    *_weight(attn.qkv_proj),
                    *_weight(attn.o_proj),
                    *_weight(mlp.gate_up_proj),
                    *_weight(mlp.down_proj),
                    mlp.down_proj.weight.shape[0],
                    mlp.down_proj.weight.shape[1],
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                    _ptr(rope.cos_sin_cache),
                    rope.cos_sin_cache.shape[0],
                    rope.cos_sin_cache.shape[1],
                    int(rope.is_neox_style),
                    attn.attn.scaling,
                    _ptr(k_cache),
                    _ptr(v_cache),
                    k_cache.stride(0),
                    int(self._dtype == torch.bfloat16),
                    *(
                        0 if m.quant is None else m.quant.bits
                        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                    ),
                )
            )
        self._args, self._pool = args, pool
        return args

    def _takes(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> bool:
        backend, pool = forward_batch.attn_backend, forward_batch.token_to_kv_pool
        return (
            forward_batch.forward_mode.is_decode()
            and hidden.dtype == self._dtype
            and hidden.device.type == "cpu"
            and hidden.shape[0] <= SMALL_ROWS
            and getattr(backend, "uses_kernel", False)
            and pool is not None
            and pool.dtype == self._dtype
            and forward_batch.req_to_token_pool is not None
        )

    def run(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers for one decode batch: (last layer's output, residual), as the modules'
        loop returns them; None when the batch does not qualify (run the modules)."""
        if not self._takes(hidden, forward_batch):
            return None
        layer_args = self._layer_args(forward_batch.token_to_kv_pool)
        first = self._layers[0]
        attn, mlp = first.self_attn, first.mlp
        rows, width = hidden.shape
        q_dim = attn.num_heads * attn.head_dim
        qkv_dim = q_dim + 2 * attn.num_kv_heads * attn.head_dim
        inter = mlp.down_proj.weight.shape[1]

        def scratch(cols: int, dtype: torch.dtype = self._dtype) -> torch.Tensor:
            return torch.empty(rows, cols, dtype=dtype)

        # normed, qkv, o, gate_up, act, attn_act (activations), then q and attn (float32)
        buffers = [scratch(c) for c in (width, qkv_dim, width, 2 * inter, inter, q_dim)]
        buffers += [scratch(q_dim, torch.float32), scratch(q_dim, torch.float32)]
        per_request = [
            t.to(torch.int64).contiguous()
            for t in (
                positions,
                forward_batch.out_cache_loc,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
            )
        ]
        shared: SharedPrefixes | None = forward_batch.attn_metadata
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        step = DecodeStepArgs(
            rows,
            _ptr(per_request[0]),
            _ptr(per_request[1]),
            _ptr(req_to_token),
            req_to_token.stride(0),
            _ptr(per_request[2]),
            _ptr(per_request[3]),
            _ptr(None if shared is None else shared.leaders),
            _ptr(None if shared is None else shared.lens),
            *(_ptr(b) for b in buffers),
            torch.get_num_threads(),
        )
        # Each layer reads x (and overwrites it: the fused add-norm works in place) and writes
        # the next layer's x into the other of two buffers. The first layer's input becomes
        # the residual, as in the modules.
        x = hidden.contiguous()
        residual: torch.Tensor | None = None
        outs = (scratch(width), scratch(width))
        for i, args in enumerate(layer_args):
            out = outs[i % 2]
            status = self._kernel(
                ctypes.addressof(args), ctypes.addressof(step), _ptr(x), _ptr(residual), _ptr(out)
            )
            if status != 0:
                raise decode_layer_error(status, i)
            if residual is None:
                residual = x
            x = out
        assert residual is not None
        return x, residual


def enable_fused_decode(model: torch.nn.Module) -> FusedDecode | None:
    """Attach a `FusedDecode` to the model's decoder stack (`model.model.fused_decode`) when
    every layer qualifies and the kernel builds; returns it, or None (logged with why)."""
    stack = getattr(model, "model", None)
    layers = list(getattr(stack, "layers", []))
    if not layers or not hasattr(stack, "fused_decode"):
        return None
    reasons = {r for r in map(_qualifies, layers) if r is not None}
    if reasons:
        logger.info("CPU fused decode off: %s", ", ".join(sorted(reasons)))
        return None
    kernel = decode_layer_kernel()
    if kernel is None:
        return None
    stack.fused_decode = FusedDecode(kernel, layers)
    logger.info(
        "CPU fused decode: %d layers run one compiled call each per decode step", len(layers)
    )
    return stack.fused_decode
