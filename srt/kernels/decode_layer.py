"""One decoder layer of a CPU decode step in one compiled call (`csrc/decode_layer.c`).

The C source includes layer_ops.c, packed_linear.c, quant_linear.c and paged_decode.c and runs
their kernels
in the layer's order, so its output equals the modules' bit for bit. This module holds the
call's C structures and the loader; `srt/model_executor/cpu_decode_layer_runner.py` decides
which batches take it and fills the structures.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

from srt.kernels.build import load
from srt.kernels.linear import packed_linear_kernel

_P, _F, _I64, _I32 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int32


class DecodeLayerArgs(ctypes.Structure):
    """`DecodeLayer` of decode_layer.c: one layer's weights, shapes and K/V buffers."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("input_eps", _F), ("post_eps", _F),
        ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("o_bias", _P),
        ("gate_up", _P), ("gate_up_bias", _P), ("down", _P), ("down_bias", _P),
        ("hidden", _I64), ("inter", _I64), ("q_heads", _I64), ("kv_heads", _I64),
        ("head_dim", _I64), ("cos_sin", _P), ("max_position", _I64), ("rot", _I64),
        ("neox", _I32), ("scale", _F), ("k_cache", _P), ("v_cache", _P), ("slot_stride", _I64),
        ("bf16", _I32), ("qkv_bits", _I32), ("o_bits", _I32), ("gate_up_bits", _I32),
        ("down_bits", _I32),
    ]  # fmt: skip


class DecodeStepArgs(ctypes.Structure):
    """`DecodeStep` of decode_layer.c: one step's batch and scratch buffers."""

    _fields_ = [
        ("rows", _I64), ("positions", _P), ("out_cache_loc", _P), ("req_to_token", _P),
        ("r2t_stride", _I64), ("pool_rows", _P), ("seq_lens", _P), ("leaders", _P),
        ("shared_lens", _P), ("normed", _P), ("qkv", _P), ("o", _P), ("gate_up", _P),
        ("act", _P), ("attn_act", _P), ("q", _P), ("attn", _P), ("threads", _I32),
    ]  # fmt: skip


def decode_layer_error(status: int, layer: int) -> Exception:
    """The exception for a non-zero status of `decode_layer` at layer `layer`."""
    if status in (1, 3):
        which = "attention" if status == 1 else "quantized matmul"
        return MemoryError(f"fused decode layer {layer}: {which} scratch allocation failed")
    return IndexError(
        f"fused decode layer {layer}: a position outside the RoPE cache or an attention head "
        "shape the kernel has no case for"
    )


def _decode_layer(library: ctypes.CDLL) -> Callable[..., int]:
    panels = packed_linear_kernel()
    if panels is not None:
        panels.share_bf16_plan(library)  # its own copy of the panels' bf16 kernels
    fn = library.decode_layer
    fn.argtypes = [ctypes.c_void_p] * 5
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def decode_layer_kernel() -> Callable[..., int] | None:
    """`decode_layer(layer_args, step_args, x, residual, out)` of csrc/decode_layer.c (0, or an
    error status for `decode_layer_error`), or None where it cannot be built."""
    return load("decode_layer.c", _decode_layer, "CPU fused decode layer")
