"""CPU attention backend: compiled kernels that read the paged pool in place.

The torch path (`torch_native`) gathers each request's K/V out of the pool into contiguous
buffers and runs batched matmuls on them, a few small ops per request and layer. This
backend calls two C kernels instead (see `srt/kernels/attention.py`), one call per layer,
no gather, no per-request Python, online softmax in float32:

- decode, `srt/kernels/csrc/paged_decode.c`: walks `req_to_token` and reads every K and V row
  once, straight from the pool, for all the query heads of a request (decode is bound by
  reading K/V); where requests hold the same leading slots (a prefix the radix cache shares,
  found once per step by `shared_prefixes`), those rows are read once for all of them;
- extend, `srt/kernels/csrc/paged_extend.c`: the new tokens of a request in blocks, each over
  the keys its last token sees (bottom-right causal over the cached prefix), a tile of keys
  at a time copied out of the pool once and multiplied against the block's query rows.

Both honour a layer's sliding window (`RadixAttention.sliding_window`: a token sees its last
`window` positions only) and its score soft-capping (`RadixAttention.logit_cap`, Gemma 2).

Where a kernel cannot run (no C compiler, a failed build, a KV dtype other than float32 or
bfloat16, a head dim other than 64 or 128, or for decode a query group over 8 heads), that
mode falls back to `torch_native`'s path, with one log line saying why.
`--attention-backend auto` picks this backend on CPU; `torch_native` stays the reference
every backend is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from attention.torch_native_backend import TorchNativeAttnBackend
from srt.kernels.attention import (
    PagedAttentionKernel,
    paged_decode_kernel,
    paged_extend_kernel,
    shared_prefixes,
)

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)
K = TypeVar("K", bound=PagedAttentionKernel)


@dataclass(slots=True)
class ExtendLens:
    """The extend kernel's per-request inputs, int64 and contiguous, planned once per batch."""

    pool_rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor


class CpuAttnBackend(TorchNativeAttnBackend):
    """Decode and extend through the compiled paged kernels, torch_native where one cannot run."""

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
        shape = (num_heads, num_kv_heads, head_dim, dtype, torch.device(device))
        self._kernel = _usable(paged_decode_kernel, "decode", *shape)
        self._extend_kernel = _usable(paged_extend_kernel, "extend", *shape)

    @property
    def uses_kernel(self) -> bool:
        return self._kernel is not None

    @property
    def uses_extend_kernel(self) -> bool:
        return self._extend_kernel is not None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if self._kernel is not None and mode.is_decode():
            # The kernel reads req_pool_indices and seq_lens, already on the batch; the shared
            # prefixes are found once here for every layer.
            forward_batch.attn_metadata = shared_prefixes(
                self._req_to_token(forward_batch),
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
            )
            return
        if self._extend_kernel is not None and mode.is_extend():
            self._decode_plan = None  # as in torch_native: an extend ends staged-K/V reuse
            prefix_lens, extend_lens = self._extend_lens(forward_batch)
            forward_batch.attn_metadata = ExtendLens(
                forward_batch.req_pool_indices.to("cpu", torch.int64).contiguous(),
                torch.tensor(prefix_lens, dtype=torch.int64),
                torch.tensor(extend_lens, dtype=torch.int64),
            )
            return
        super().init_forward_metadata(forward_batch)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if self._extend_kernel is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        lens: ExtendLens = forward_batch.attn_metadata
        per_request = (lens.pool_rows, lens.prefix_lens, lens.extend_lens)
        return self._through(
            self._extend_kernel,
            per_request,
            q,
            k,
            v,
            layer,
            forward_batch,
            save_kv_cache,
            window=layer.sliding_window,
            softcap=layer.logit_cap,
        )

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
        per_request = (forward_batch.req_pool_indices, forward_batch.seq_lens)
        return self._through(
            self._kernel,
            per_request,
            q,
            k,
            v,
            layer,
            forward_batch,
            save_kv_cache,
            # A windowed layer reads each request's last tokens only: nothing to share.
            shared=forward_batch.attn_metadata if layer.sliding_window is None else None,
            window=layer.sliding_window,
            softcap=layer.logit_cap,
        )

    def _through(
        self,
        kernel: PagedAttentionKernel,
        per_request: tuple[torch.Tensor, ...],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        **options: Any,
    ) -> torch.Tensor:
        """Save the new K/V, then run `kernel` over the pool (`options` are the kernel's
        keyword arguments); the output in q's dtype."""
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        req_to_token = self._req_to_token(forward_batch)
        out = kernel(
            q,
            k_cache,
            v_cache,
            req_to_token,
            *per_request,
            layer.num_heads,
            layer.scaling,
            **options,
        )
        return out.to(q.dtype)


def _usable(
    load: Callable[[], K | None],
    mode: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> K | None:
    """The `mode` kernel if it can run this model here, else None (logged with why)."""
    if not PagedAttentionKernel.supports(dtype, device):
        reason = f"a {dtype} KV pool on {device}"
    else:
        kernel = load()  # None, with a logged reason, where it cannot be built
        if kernel is None or kernel.supports_shape(num_heads, num_kv_heads, head_dim):
            return kernel
        reason = f"{num_heads} query heads over {num_kv_heads} KV heads of dim {head_dim}"
    logger.warning("CPU %s kernel cannot run %s; %s uses the torch path", mode, reason, mode)
    return None
