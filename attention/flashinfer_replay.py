"""CUDA-graph decode for the flashinfer backend: capture plans in full, replay re-plans lean.

`GraphDecodePlans` (built by `FlashInferAttnBackend.init_cuda_graph_state`) owns the
persistent page table every captured graph reads (indptr / indices / last_page_len, shared
by all sizes and variants) and one `use_cuda_graph=True` decode wrapper per captured batch
size and backend variant (window, soft cap, scale: `flashinfer_backend.Variant`).

What a replay must refresh. A captured graph replays FlashInfer's kernels with the scalars
of the plan it was captured with (`_plan_info`: padded batch, split-kv, workspace offsets).
Under CUDA graphs those depend on the batch size alone (FlashInfer 0.7.2 always splits KV
there and pads the work list to a size set by the batch size and the GPU), so they stay
valid. What changes with the lengths is data the kernels read from memory: the page table,
and the work partition (request / tile indices, chunk size) that the plan computes on the
CPU from the host indptr and uploads into the wrapper's int workspace.

So `replay` does only that:
- the page table is built on the device straight into the graph's buffers
  (`build_kv_indices(out=...)`), indptr and last_page_len from the staged `seq_lens`: no
  fresh tensor for `plan` to copy in, no host -> device copy of indptr;
- the host indptr comes from `seq_lens_cpu` with numpy;
- `FastDecodePlan.plan` calls the plan module's own `plan` (FlashInfer's C++ scheduler:
  writes the work partition into the wrapper's pinned buffer, then one async copy to the
  int workspace) with the arguments `wrapper.plan` would pass, prebuilt at capture: module
  handle, workspaces, empty dtype tensors, the tensor-core path's constant qo_indptr. What
  `wrapper.plan` does besides is skipped: argument and backend resolution, copies of
  indptr / indices / last_page_len into buffers already filled, the module lookup, the
  host `get_seq_lens`.
No device -> host copy or sync on this path; the pinned buffer is guarded as for every
plan (`PinnedPlanGuard`).

This reads FlashInfer internals (`WRAPPER_INTERNALS`, and the positional arguments of the
fa2 decode and prefill modules' `plan` in 0.7.2), so `fast_plan_or_reason` takes it only on
0.7.2 with every attribute present and the wrapper on fa2 in graph mode over our buffers,
and `capture` keeps it only if, run on the capture batch right after the full plan, it
leaves the same plan info and the same pinned bytes. Otherwise replay calls `wrapper.plan`
as before; `paths` says per batch size which runs (logged once per distinct path).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from attention.flashinfer_utils import build_kv_indices, host_kv_indptr, host_lens

if TYPE_CHECKING:
    from attention.flashinfer_backend import FlashInferAttnBackend
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# The FlashInfer release whose wrapper internals and module `plan` arguments this reads.
FAST_PLAN_VERSION = "0.7.2"
# BatchDecodeWithPagedKVCacheWrapper attributes the fast plan reads (or sets: _plan_info).
WRAPPER_INTERNALS = (
    "_cached_module",
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_plan_info",
    "_paged_kv_indptr_buf",
    "_paged_kv_indices_buf",
    "_paged_kv_last_page_len_buf",
    "_fixed_batch_size",
    "_use_cuda_graph",
    "_use_tensor_cores",
    "_backend",
)
PageTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # indptr, indices, last_page_len


class FastDecodePlan:
    """The per-step part of `wrapper.plan` for one captured batch size (see module doc)."""

    __slots__ = ("_head", "_module_plan", "_tail", "out", "tensor_cores", "wrapper")

    def __init__(
        self,
        wrapper: Any,
        out: PageTable,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        window_left: int = -1,
        logits_soft_cap: float = 0.0,
    ) -> None:
        self.wrapper = wrapper
        self.out = out  # the graph buffers' views for this batch size
        self.tensor_cores = bool(wrapper._use_tensor_cores)
        self._module_plan = wrapper._cached_module.plan
        bs = wrapper._fixed_batch_size
        workspaces = (
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
        )
        if self.tensor_cores:
            # The prefill module's plan as 0.7.2 calls it for tensor-core decode: one query
            # row per request, not causal, the window, no fixed split, fa2's extra arguments
            # (the soft cap is a run argument there).
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
            self._head: tuple[Any, ...] = (*workspaces, qo_indptr)
            self._tail: tuple[Any, ...] = (bs, bs, num_qo_heads, num_kv_heads, page_size, True)
            self._tail += (head_dim, head_dim, False, window_left, -1, False, 0, 0)
        else:
            # The decode module's plan: window, soft cap, dtypes as empty tensors.
            empty = torch.empty(0, dtype=dtype)
            self._head = workspaces
            self._tail = (bs, num_qo_heads, num_kv_heads, page_size, True, window_left)
            self._tail += (logits_soft_cap, head_dim, head_dim, empty, empty)

    def plan(self, indptr: torch.Tensor, lens: np.ndarray) -> None:
        """Recompute and upload the work partition for host `indptr` (int32 [bs+1]) and
        `lens` (int64 [bs], the requests' KV lengths)."""
        wrapper = self.wrapper
        if self.tensor_cores:
            kv_lens = torch.from_numpy(lens.astype(np.int32))
            wrapper._plan_info = self._module_plan(*self._head, indptr, kv_lens, *self._tail)
            wrapper._max_kv_len = int(lens.max())
        else:
            wrapper._plan_info = self._module_plan(*self._head, indptr, *self._tail)


def fast_plan_or_reason(
    flashinfer: Any, wrapper: Any, out: PageTable, **shape: Any
) -> tuple[FastDecodePlan | None, str]:
    """A FastDecodePlan for a freshly planned graph wrapper, or None and why not."""
    version = str(getattr(flashinfer, "__version__", "unknown"))
    if not version.startswith(FAST_PLAN_VERSION):
        return None, f"flashinfer {version} is not {FAST_PLAN_VERSION}"
    missing = [name for name in WRAPPER_INTERNALS if not hasattr(wrapper, name)]
    if missing:
        return None, f"the decode wrapper lacks {', '.join(missing)}"
    if not callable(getattr(wrapper._cached_module, "plan", None)):
        return None, "the wrapper's module has no plan()"
    if not wrapper._use_cuda_graph or wrapper._backend != "fa2":
        return None, f"not an fa2 CUDA-graph wrapper (backend {wrapper._backend!r})"
    if getattr(wrapper, "_jit_module", None) is not None or getattr(wrapper, "_cudnn_auto", False):
        return None, "the wrapper runs a custom or cuDNN module"
    if getattr(wrapper, "_q_len_per_req", 1) != 1:
        return None, "the wrapper plans more than one query per request"
    theirs = (
        wrapper._paged_kv_indptr_buf,
        wrapper._paged_kv_indices_buf,
        wrapper._paged_kv_last_page_len_buf,
    )
    if any(a.data_ptr() != b.data_ptr() or len(a) != len(b) for a, b in zip(theirs, out)):
        return None, "the wrapper does not read the graph's page-table buffers"
    return FastDecodePlan(wrapper, out, **shape), "fast"


def self_check(fast: FastDecodePlan, indptr: torch.Tensor, lens: np.ndarray) -> str | None:
    """Run the fast plan where the full plan just ran, on the same batch: None if it left
    the same plan info and pinned bytes, else what differed."""
    wrapper = fast.wrapper
    try:
        expected_info = list(wrapper._plan_info)
        expected_bytes = wrapper._pin_memory_int_workspace_buffer.clone()
        fast.plan(indptr, lens)
        info = list(wrapper._plan_info)
    except Exception as exc:  # noqa: BLE001 - any failure only means: keep the full plan
        return f"the fast plan failed: {exc!r}"
    if info != expected_info:
        return "the fast plan's plan info differs from the full plan's"
    if not torch.equal(wrapper._pin_memory_int_workspace_buffer, expected_bytes):
        return "the fast plan's work partition differs from the full plan's"
    return None


class GraphDecodePlans:
    """The page-table buffers, decode wrappers and replay plans of the captured graphs:
    `wrappers[bs][variant]`, `fast[bs][variant]` (absent: that graph re-plans in full)."""

    def __init__(self, backend: FlashInferAttnBackend, max_bs: int, max_pages_per_req: int):
        device = backend.workspace.device
        self.backend = backend
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=device)
        self.wrappers: dict[int, dict[Any, Any]] = {}
        self.fast: dict[int, dict[Any, FastDecodePlan]] = {}
        self.paths: dict[int, str] = {}  # batch size -> "fast", or which full plan and why

    def capture(self, forward_batch: ForwardBatch) -> None:
        """Plan new graph wrappers (one per variant) for the (dummy) batch in full, then
        choose their replay: fast only if every variant's fast plan passes its check."""
        backend, bs = self.backend, forward_batch.batch_size
        out = (self.indptr[: bs + 1], self.indices, self.last_page_len[:bs])
        wrappers = {variant: backend.new_graph_wrapper(out) for variant in backend.variants}
        self.wrappers[bs] = wrappers
        backend.plan_decode(wrappers, forward_batch)
        self.fast.pop(bs, None)
        path = "full wrapper.plan: fast_replay=False"
        if backend.fast_replay:
            path = self._try_fast(wrappers, out, forward_batch)
        if path not in self.paths.values():
            logger.info("flashinfer graph replay (batch size %d and like it): %s", bs, path)
        self.paths[bs] = path

    def _try_fast(
        self, wrappers: dict[Any, Any], out: PageTable, forward_batch: ForwardBatch
    ) -> str:
        backend = self.backend
        lens = host_lens(forward_batch.seq_lens_cpu)
        indptr = torch.from_numpy(host_kv_indptr(lens, backend.page_size))
        plans: dict[Any, FastDecodePlan] = {}
        for variant, wrapper in wrappers.items():
            fast, reason = fast_plan_or_reason(
                backend.flashinfer,
                wrapper,
                out,
                num_qo_heads=backend.num_heads,
                num_kv_heads=backend.num_kv_heads,
                head_dim=backend.head_dim,
                page_size=backend.page_size,
                dtype=backend.dtype,
                window_left=variant.window_left,
                logits_soft_cap=variant.logits_soft_cap,
            )
            if fast is None:
                return f"full wrapper.plan: {reason}"
            backend.guard.before_plan(wrapper)
            failed = self_check(fast, indptr, lens)
            backend.guard.after_plan(wrapper)
            if failed is not None:
                backend.plan_decode(wrappers, forward_batch)  # whatever the check left: redo
                return f"full wrapper.plan: {failed}"
            plans[variant] = fast
        self.fast[forward_batch.batch_size] = plans
        return "fast"

    def replay(self, forward_batch: ForwardBatch) -> dict[Any, Any]:
        """Re-plan the graph of this padded DECODE batch (seq_lens / req_pool_indices: the
        graph's device inputs, filled; seq_lens_cpu: host); returns the planned wrapper of
        each variant."""
        backend, bs = self.backend, forward_batch.batch_size
        plans = self.fast.get(bs)
        if plans is None:
            backend.plan_decode(self.wrappers[bs], forward_batch)
            return self.wrappers[bs]
        req_pool = backend.check_pool(forward_batch)
        lens = host_lens(forward_batch.seq_lens_cpu)
        if len(lens) != bs:  # FlashInfer's plan would read past a short indptr
            raise ValueError(f"seq_lens_cpu has {len(lens)} entries for a graph of {bs}")
        indptr = host_kv_indptr(lens, backend.page_size)
        total = int(indptr[-1])
        if total > len(self.indices):
            raise ValueError(f"{total} pages exceed the graph page table's {len(self.indices)}")
        build_kv_indices(
            req_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            backend.page_size,
            total_pages=total,
            out=(self.indptr[: bs + 1], self.indices, self.last_page_len[:bs]),
        )
        host_indptr = torch.from_numpy(indptr)
        for fast in plans.values():
            backend.guard.before_plan(fast.wrapper)
            fast.plan(host_indptr, lens)
            backend.guard.after_plan(fast.wrapper)
        return self.wrappers[bs]
