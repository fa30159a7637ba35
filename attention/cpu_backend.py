"""CPU attention backend: decode through a compiled kernel that reads the paged pool in place.

Decode on a CPU is bound by reading K/V. The torch path (`torch_native`) gathers each
request's K/V out of the pool into contiguous buffers and runs batched matmuls on them;
this backend instead calls `attention/csrc/paged_decode.c` (see `attention/cpu_kernels.py`),
which walks `req_to_token` and reads every K and V row once, straight from the pool, with
an online softmax in float32: one call per layer, no gather, no staging, no per-request
Python. Extend (prefill) batches run the `torch_native` code, which is matmul-bound there.

Where the kernel cannot run (no C compiler, a failed build, a KV dtype other than float32 or
bfloat16, a query group over 8 heads, a head dim other than 64 or 128), decode falls back to
`torch_native`'s path, with one log line saying why. `--attention-backend auto` picks this
backend on CPU; `torch_native` stays the reference every backend is tested against.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from attention.cpu_kernels import PagedDecodeKernel, paged_decode_kernel
from attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class CpuAttnBackend(TorchNativeAttnBackend):
    """torch_native's extend, and decode through the compiled paged-decode kernel."""

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._kernel = _usable_kernel(
            num_heads, num_kv_heads, head_dim, dtype, torch.device(device)
        )

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self._kernel is not None and forward_batch.forward_mode.is_decode():
            # The kernel reads req_pool_indices and seq_lens, already on the batch.
            forward_batch.attn_metadata = None
            return
        super().init_forward_metadata(forward_batch)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if self._kernel is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = self._kernel(
            q,
            k_cache,
            v_cache,
            self._req_to_token(forward_batch),
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            layer.num_heads,
            layer.scaling,
        )
        return out.to(q.dtype)


def _usable_kernel(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> PagedDecodeKernel | None:
    """The kernel if it can run this model's decode here, else None (logged with why)."""
    if not PagedDecodeKernel.supports(dtype, device):
        reason = f"a {dtype} KV pool on {device}"
    else:
        kernel = paged_decode_kernel()  # None, with a logged reason, where it cannot be built
        if kernel is None or kernel.supports_shape(num_heads, num_kv_heads, head_dim):
            return kernel
        reason = (
            f"{num_heads} query heads over {num_kv_heads} KV heads of dim {head_dim} "
            "(query groups of 1-8, head dims 64 and 128)"
        )
    logger.warning("CPU decode kernel cannot run %s; decode uses the torch path", reason)
    return None
