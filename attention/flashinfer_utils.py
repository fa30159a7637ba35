"""Paged-KV page tables in FlashInfer's CSR form, built with tensor ops (no flashinfer import).

FlashInfer describes each request's KV as a list of pages: `kv_indptr[b] .. kv_indptr[b+1]`
index `kv_indices`, the page ids of request b in order, and `kv_last_page_len[b]` (1 ..
page_size) says how many slots of its last page hold tokens. Our pool stores slot
`page * page_size + offset` at row `slot` of a `[num_slots, Hkv, D]` buffer, so the paged
view FlashInfer reads is `buffer.view(-1, page_size, Hkv, D)` ("NHD") and a request's page
ids are `req_to_token[row, p * page_size] // page_size` for p = 0, 1, ... (the allocator
hands out whole pages and a request's token at position i sits at offset i % page_size).

`build_kv_indices` runs on the device of `req_to_token` with no per-request Python loop and
no device -> host copy when `total_pages` is given; with `out=` it writes straight into
caller-owned buffers (the CUDA graph's persistent page table). `host_page_table` derives
the same indptr / last_page_len on the host from `seq_lens_cpu` with numpy, which is what
FlashInfer's plan step reads (its work partition is computed on the CPU). Both use one
formula, pages = ceil(n / page_size) and last = n - (pages - 1) * page_size, so they agree
entry for entry. `PinnedPlanGuard` orders a wrapper's plans around the upload of its
pinned plan buffer. `Variant` is what a plan fixes per layer kind (window, soft cap, scale).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

# GQA group size from which decode runs FlashInfer's tensor-core (prefill) kernels: with a
# group of 4+ query heads per KV head the tensor-core path wins (SGLang uses the same cut).
TENSOR_CORE_MIN_GROUP = 4

HostLens = Sequence[int] | np.ndarray

if TYPE_CHECKING:
    from attention.radix_attention import RadixAttention


def num_pages(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def host_lens(seq_lens: HostLens) -> np.ndarray:
    """`seq_lens_cpu` (a list, or an array from a staging buffer) as int64, no Python loop."""
    return np.asarray(seq_lens, dtype=np.int64)


def host_kv_indptr(lens: np.ndarray, page_size: int) -> np.ndarray:
    """int32 [B+1]: exclusive prefix sum of each request's page count."""
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum((lens + (page_size - 1)) // page_size, dtype=np.int32, out=indptr[1:])
    return indptr


def host_page_table(seq_lens: HostLens, page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indptr int32 [B+1], kv_last_page_len int32 [B], total pages), on the host."""
    lens = host_lens(seq_lens)
    indptr = host_kv_indptr(lens, page_size)
    last = (lens - (np.diff(indptr) - 1) * page_size).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(last), int(indptr[-1])


def host_indptr(lens: HostLens) -> torch.Tensor:
    """Exclusive prefix sum of `lens` as an int32 [B+1] host tensor (qo / ragged kv indptr)."""
    arr = host_lens(lens)
    out = np.zeros(len(arr) + 1, dtype=np.int32)
    np.cumsum(arr, dtype=np.int32, out=out[1:])
    return torch.from_numpy(out)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CSR page table of a batch, on `req_to_token`'s device.

    req_to_token int32 [rows, max_context_len], contiguous; req_pool_indices [B] (rows of
    the batch); seq_lens [B] (tokens with KV, >= 1). Returns (kv_indptr int32 [B+1],
    kv_indices int32 [total_pages], kv_last_page_len int32 [B]). `total_pages` (the sum of
    ceil(seq_len / page_size), known on the host from seq_lens_cpu) avoids a device -> host
    sync. `out` = (indptr [B+1], indices [>= total_pages], last_page_len [B]) int32 buffers
    to write into instead of new tensors (needs `total_pages`); out's indptr[0] must already
    hold 0, as the graph's zero-initialised buffer always does.
    """
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = req_pool_indices.to(device=device, dtype=torch.int64)
    batch = seq_lens.numel()
    if out is None:
        indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        last_page_len = torch.empty(batch, dtype=torch.int32, device=device)
    else:
        assert total_pages is not None, "out= needs the host-known total_pages"
        indptr, indices_buf, last_page_len = out
    if page_size == 1:
        pages = seq_lens
        last_page_len.fill_(1)
    else:
        pages = torch.div(seq_lens + (page_size - 1), page_size, rounding_mode="floor")
        # last = n - (pages - 1) * page_size, written (and narrowed to int32) in place.
        torch.sub(seq_lens, pages, alpha=page_size, out=last_page_len)
        last_page_len.add_(page_size)
    torch.cumsum(pages, dim=0, dtype=torch.int32, out=indptr[1:])
    if total_pages is None:
        total_pages = int(indptr[-1])
    indices = (
        torch.empty(total_pages, dtype=torch.int32, device=device)
        if out is None
        else indices_buf[:total_pages]
    )
    # Entry j of kv_indices is page j - indptr[r] of request r = owner(j), whose first slot
    # sits at flat offset rows[r] * stride + (j - indptr[r]) * page_size of req_to_token:
    # base[r] + j * page_size with base[r] = rows[r] * stride - indptr[r] * page_size.
    entry = torch.arange(total_pages, dtype=torch.int32, device=device)
    owner = torch.searchsorted(indptr[1:], entry, right=True)
    base = torch.sub(rows * req_to_token.stride(0), indptr[:-1], alpha=page_size)
    flat = torch.add(base[owner], entry, alpha=page_size)
    torch.index_select(req_to_token.view(-1), 0, flat, out=indices)
    if page_size != 1:
        indices.floor_divide_(page_size)
    return indptr, indices, last_page_len


def decode_use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Use FlashInfer's tensor-core decode for GQA groups of TENSOR_CORE_MIN_GROUP or more."""
    return num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP


def plan_event_factory(device: torch.device) -> Callable[[], Any] | None:
    """How to mark "this plan's upload is done": a CUDA event on a GPU; None elsewhere,
    where nothing is copied asynchronously."""
    return torch.cuda.Event if device.type == "cuda" else None


class PinnedPlanGuard:
    """Keeps a wrapper's next plan from rewriting its pinned plan buffer under the upload
    of the previous one.

    FlashInfer's plan writes its work partition into the wrapper's pinned
    `_pin_memory_int_workspace_buffer`, then queues an async copy of it on the current
    stream. The scheduler launches step N+1 while the GPU still runs step N, so the host
    may plan N+1 before the copy queued by N's plan has run. One event per wrapper is
    recorded after each plan; the next plan of that wrapper waits on it only while
    `query()` says it has not completed. An event rather than a second pinned buffer: the
    wait almost never blocks (N's copy is queued right behind step N-1, whose results the
    loop has waited for before it plans N+1), a second buffer would still need an event
    against a host two steps ahead, and it would cost another 8 MiB of pinned memory per
    wrapper (one per captured batch size).
    """

    def __init__(self, new_event: Callable[[], Any] | None) -> None:
        self._new_event = new_event
        self._events: dict[int, Any] = {}  # id(wrapper) -> event; the backend keeps them
        self.waits = 0  # plans that had to block

    def before_plan(self, wrapper: Any) -> None:
        event = self._events.get(id(wrapper))
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()

    def after_plan(self, wrapper: Any) -> None:
        if self._new_event is None:
            return
        event = self._events.get(id(wrapper))
        if event is None:
            event = self._events[id(wrapper)] = self._new_event()
        event.record()


@dataclass(frozen=True, slots=True)
class Variant:
    """What FlashInfer fixes per plan besides the batch: a layer's window, cap and scale."""

    window_left: int  # keys a query sees before itself; -1: all of them
    logits_soft_cap: float  # scores become cap * tanh(score / cap); 0.0: as they are
    sm_scale: float

    @classmethod
    def of(cls, layer: RadixAttention) -> Variant:
        window = -1 if layer.sliding_window is None else layer.sliding_window - 1
        return cls(window, float(layer.logit_cap or 0.0), float(layer.scaling))

    def plan_kwargs(self) -> dict[str, Any]:
        return {
            "window_left": self.window_left,
            "logits_soft_cap": self.logits_soft_cap,
            "sm_scale": self.sm_scale,
        }
