"""FlashInfer attention (GPU): plan once per batch, run per layer, CUDA-graph decode.

Plan (`init_forward_metadata`, on the host, once per batch) plans exactly one wrapper:

- EXTEND / MIXED where no request has a cached prefix: ragged prefill, causal, straight
  over the new tokens' K/V as the projection produced them; they are saved to the pool too.
- EXTEND / MIXED where some request has a prefix (decodes inside a MIXED batch included):
  the new K/V are saved first, then paged prefill over prefix + new tokens read from the
  pool, causal with the mask aligned bottom-right (query j of a request with prefix P sees
  keys 0 .. P + j).
- DECODE: paged decode; tensor-core kernels when the GQA group is large enough
  (`decode_use_tensor_cores`).

The CSR page table (`indptr / indices / last_page_len`) comes from `flashinfer_utils`: the
indices are gathered from `req_to_token` on the device, indptr and last_page_len are built
on the host from `seq_lens_cpu` (FlashInfer's plan wants them there; handing it device
tensors would make it copy them back with a sync). Run (`forward_extend` /
`forward_decode`, once per layer) makes no host decisions: it views the layer's K/V pool
buffers as `[pages, page_size, Hkv, D]` ("NHD") and calls the planned wrapper.

CUDA graphs (`flashinfer_replay.GraphDecodePlans`): one decode wrapper per captured batch
size (`use_cuda_graph=True`) over persistent indptr / indices / last_page_len buffers
shared by all of them. Capture plans it in full; replay, once per graph step, writes the
page table on the device straight into those buffers from the staged `seq_lens` and re-runs
only FlashInfer's work-partition plan from a numpy indptr of `seq_lens_cpu`. Why: the graph
step is launched while the previous one still runs, so its plan must not wait for the
device: no device -> host copy, no pageable host -> device copy (which the driver may
serialise with the stream), no per-request Python loop. Where FlashInfer's internals are not
the 0.7.2 ones this relies on, replay falls back to `wrapper.plan` (logged once).

Variants. FlashInfer fixes a layer's sliding window, score soft cap and softmax scale at
plan time (a window or a cap even selects another compiled kernel), so layers that differ in
them cannot share a planned wrapper. The backend is built with the model's attention layers
and keeps one set of wrappers per distinct `Variant` (a Gemma 2 model has two: local layers
with a window and global ones, both soft-capped; a Llama has one); each batch plans every
variant over the same page table, and each layer runs its own variant's wrapper. A window of
W positions is FlashInfer's `window_left = W - 1` (a query sees itself and W - 1 keys back).

Every plan, eager or graph, writes the wrapper's pinned plan buffer, whose upload may still
be queued when the host, a step ahead of the GPU, plans again: `PinnedPlanGuard` records an
event per wrapper after each plan and waits on it before the next only if `query()` says it
is not done. An event rather than a second pinned buffer: the wait almost never blocks, and
double-buffering would still need the event against a host two steps ahead (the trade-off is
spelled out in `PinnedPlanGuard`). One float workspace, allocated
once and zeroed, serves every wrapper (they never run at the same time); every wrapper runs
FlashInfer's FA2 kernels (`FLASHINFER_KERNELS`). `flashinfer` is imported when the backend
is built; the registry imports this module only when it is chosen.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attention import flashinfer_utils
from attention.base import AttentionBackend
from attention.flashinfer_replay import GraphDecodePlans, PageTable
from attention.flashinfer_utils import (
    PinnedPlanGuard,
    Variant,
    build_kv_indices,
    decode_use_tensor_cores,
    host_indptr,
    host_page_table,
)

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# FlashInfer keeps split-KV partial outputs here; large prefills with many requests need
# more than the 128 MiB of its examples.
WORKSPACE_BYTES = 256 << 20
KV_LAYOUT = "NHD"
# Every wrapper is pinned to FlashInfer's FA2 kernels. With "auto", FlashInfer 0.7.2 picks
# FA3 for prefill on SM90 (H100 / H200) but FA2 for tensor-core decode: two heavy JIT
# modules per head_dim, compiled on first use, where one serves both. FA3 has not been
# measured faster on our workloads; revisit this only with a benchmark that shows it is.
FLASHINFER_KERNELS = "fa2"


class PlanKind(enum.Enum):
    RAGGED_PREFILL = "ragged_prefill"
    PAGED_PREFILL = "paged_prefill"
    DECODE = "decode"


@dataclass(slots=True)
class FlashInferMetadata:
    kind: PlanKind
    wrappers: dict[Variant, Any]  # the planned flashinfer wrapper of each variant

    @property
    def wrapper(self) -> Any:
        """The planned wrapper of a backend with one variant."""
        (only,) = self.wrappers.values()
        return only


@dataclass(slots=True)
class VariantWrappers:
    """One variant's eager wrappers (graph wrappers live in `GraphDecodePlans`)."""

    ragged_prefill: Any
    paged_prefill: Any
    decode: Any


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cuda",
        page_size: int = 1,
        sm_scale: float | None = None,
        decode_tensor_cores: bool | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        fast_replay: bool = True,
        layers: Sequence[RadixAttention] = (),
        **_unused: Any,
    ) -> None:
        """`layers`: the model's attention layers, whose windows, caps and scales are the
        variants every batch plans; none: one variant, no window or cap, `sm_scale`."""
        import flashinfer  # the GPU package: imported here, when the backend is chosen

        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer backend needs a float16 or bfloat16 model, not {dtype}; "
                "use --dtype bfloat16 or --attention-backend torch_native"
            )
        self.flashinfer = flashinfer
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.page_size = page_size
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        if decode_tensor_cores is None:
            decode_tensor_cores = decode_use_tensor_cores(num_heads, num_kv_heads)
        self.decode_tensor_cores = decode_tensor_cores
        # Zeros, not empty: FlashInfer documents that the float workspace "must be
        # initialized to 0 for its first use" (BatchDecodeWithPagedKVCacheWrapper; the
        # prefill wrappers share this buffer); torch.empty would hand it whatever the
        # caching allocator last kept in that memory. Once, at start-up: cheap.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        found = dict.fromkeys(Variant.of(layer) for layer in layers)  # in layer order
        self.variants = list(found) or [Variant(-1, 0.0, self.sm_scale)]
        self.wrappers = {variant: self._new_wrappers() for variant in self.variants}
        # Graph replays re-plan through FlashInfer internals when it is 0.7.2 (see
        # flashinfer_replay); False keeps `wrapper.plan` there.
        self.fast_replay = fast_replay
        self.guard = PinnedPlanGuard(flashinfer_utils.plan_event_factory(self.workspace.device))
        self.graphs: GraphDecodePlans | None = None
        logger.info(
            "flashinfer backend: %s kernels, page size %d, decode tensor cores %s, "
            "workspace %d MiB, %d variant(s): %s",
            FLASHINFER_KERNELS,
            page_size,
            decode_tensor_cores,
            workspace_bytes >> 20,
            len(self.variants),
            ", ".join(
                f"window_left {v.window_left}, soft cap {v.logits_soft_cap:g}"
                for v in self.variants
            ),
        )

    def _new_wrappers(self) -> VariantWrappers:
        flashinfer = self.flashinfer
        return VariantWrappers(
            flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, KV_LAYOUT, backend=FLASHINFER_KERNELS
            ),
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT, backend=FLASHINFER_KERNELS
            ),
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                KV_LAYOUT,
                use_tensor_cores=self.decode_tensor_cores,
                backend=FLASHINFER_KERNELS,
            ),
        )

    # ---- plan -------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.check_pool(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_decode():
            decoders = {variant: w.decode for variant, w in self.wrappers.items()}
            self.plan_decode(decoders, forward_batch)
        elif mode.is_extend():
            self._plan_extend(forward_batch)
        else:
            forward_batch.attn_metadata = None

    def _plan_extend(self, forward_batch: ForwardBatch) -> None:
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        extend_lens = forward_batch.extend_seq_lens_cpu
        if prefix_lens is None:
            assert forward_batch.extend_prefix_lens is not None
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
        if extend_lens is None:
            assert forward_batch.extend_seq_lens is not None
            extend_lens = forward_batch.extend_seq_lens.tolist()
        qo_indptr = host_indptr(extend_lens)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        if not any(prefix_lens):
            for variant, w in self.wrappers.items():
                kwargs = self._plan_kwargs(variant)
                self._plan(w.ragged_prefill, qo_indptr, qo_indptr, *heads, causal=True, **kwargs)
            forward_batch.attn_metadata = FlashInferMetadata(
                PlanKind.RAGGED_PREFILL,
                {variant: w.ragged_prefill for variant, w in self.wrappers.items()},
            )
            return
        table = self._page_table(forward_batch)
        for variant, w in self.wrappers.items():
            kwargs = self._plan_kwargs(variant)
            self._plan(
                w.paged_prefill, qo_indptr, *table, *heads, self.page_size, causal=True, **kwargs
            )
        forward_batch.attn_metadata = FlashInferMetadata(
            PlanKind.PAGED_PREFILL,
            {variant: w.paged_prefill for variant, w in self.wrappers.items()},
        )

    def plan_decode(self, wrappers: dict[Variant, Any], forward_batch: ForwardBatch) -> None:
        """The full plan of each variant's decode wrapper over one page table (eager, graph
        capture, graph fallback)."""
        table = self._page_table(forward_batch)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        for variant, wrapper in wrappers.items():
            self._plan(wrapper, *table, *heads, **self._plan_kwargs(variant))
        forward_batch.attn_metadata = FlashInferMetadata(PlanKind.DECODE, dict(wrappers))

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """`wrapper.plan`, once the upload of its previous plan has left its pinned buffer."""
        self.guard.before_plan(wrapper)
        wrapper.plan(*args, **kwargs)
        self.guard.after_plan(wrapper)

    def _plan_kwargs(self, variant: Variant) -> dict[str, Any]:
        return {
            **variant.plan_kwargs(),
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
            "non_blocking": True,
        }

    def _page_table(
        self, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(host indptr, device indices, host last_page_len) of the batch's seq_lens."""
        req_pool = self.check_pool(forward_batch)
        indptr, last_page_len, total = host_page_table(forward_batch.seq_lens_cpu, self.page_size)
        _, indices, _ = build_kv_indices(
            req_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.page_size,
            total_pages=total,
        )
        return indptr, indices, last_page_len

    def check_pool(self, forward_batch: ForwardBatch) -> Any:
        req_pool = forward_batch.req_to_token_pool
        kv_pool = forward_batch.token_to_kv_pool
        assert req_pool is not None and kv_pool is not None, "the batch needs its pools"
        if kv_pool.page_size != self.page_size:
            raise ValueError(
                f"KV pool page size {kv_pool.page_size} != backend page size {self.page_size}"
            )
        return req_pool

    # ---- CUDA graphs ------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        self.graphs = GraphDecodePlans(self, max_bs, max_pages_per_req)

    def new_graph_wrapper(self, page_table: PageTable) -> Any:
        """A CUDA-graph decode wrapper of batch size len(last_page_len) over the graph's
        persistent (indptr, indices, last_page_len) views."""
        indptr, indices, last_page_len = page_table
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
            backend=FLASHINFER_KERNELS,
        )

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        assert self.graphs is not None, "call init_cuda_graph_state first"
        self.graphs.capture(forward_batch)
        wrappers = self.graphs.wrappers[forward_batch.batch_size]
        forward_batch.attn_metadata = FlashInferMetadata(PlanKind.DECODE, wrappers)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Re-plan the captured graph of `forward_batch.batch_size`: a padded DECODE batch
        whose seq_lens / req_pool_indices are the graph's device inputs (already filled)
        and whose seq_lens_cpu is on the host. Nothing here waits for the device."""
        assert self.graphs is not None, "call init_cuda_graph_state first"
        wrappers = self.graphs.replay(forward_batch)
        forward_batch.attn_metadata = FlashInferMetadata(PlanKind.DECODE, wrappers)

    # ---- run --------------------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta: FlashInferMetadata = forward_batch.attn_metadata
        wrapper = self._layer_wrapper(layer, meta)
        q3 = q.contiguous().view(-1, self.num_heads, self.head_dim)
        if meta.kind is PlanKind.RAGGED_PREFILL:
            out = wrapper.run(
                q3,
                k.contiguous().view(-1, self.num_kv_heads, self.head_dim),
                v.contiguous().view(-1, self.num_kv_heads, self.head_dim),
            )
            if save_kv_cache:
                self.save_kv(layer, forward_batch, k, v)
        else:
            if save_kv_cache:
                self.save_kv(layer, forward_batch, k, v)
            out = wrapper.run(q3, self._paged_kv(layer, forward_batch))
        return out.view(-1, self.num_heads * self.head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta: FlashInferMetadata = forward_batch.attn_metadata
        wrapper = self._layer_wrapper(layer, meta)
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        q3 = q.contiguous().view(-1, self.num_heads, self.head_dim)
        out = wrapper.run(q3, self._paged_kv(layer, forward_batch))
        return out.view(-1, self.num_heads * self.head_dim)

    def _paged_kv(
        self, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool buffers [slots, Hkv, D] viewed as [pages, page_size, Hkv, D]."""
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        return k_cache.view(shape), v_cache.view(shape)

    def _layer_wrapper(self, layer: RadixAttention, meta: FlashInferMetadata) -> Any:
        """The planned wrapper of the layer's variant. The plan fixed heads, window, cap and
        scale; a layer that matches none of the planned variants is an error, not a run
        with another layer's."""
        planned = (self.num_heads, self.num_kv_heads, self.head_dim)
        wrapper = meta.wrappers.get(Variant.of(layer))
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != planned or wrapper is None:
            raise ValueError(
                f"layer {layer.layer_id} ({layer.num_heads}/{layer.num_kv_heads} heads, head_dim "
                f"{layer.head_dim}, {Variant.of(layer)}) matches no planned variant of this "
                f"backend ({self.num_heads}/{self.num_kv_heads} heads, head_dim {self.head_dim}, "
                f"{self.variants})"
            )
        return wrapper
