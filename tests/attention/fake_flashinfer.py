"""A pure-torch stand-in for the three flashinfer wrappers the backend uses, for CPU tests.

It implements FlashInfer's documented contract, strictly: int32 CSR tensors, 1 <=
last_page_len <= page_size, "NHD" paged caches `[pages, page_size, Hkv, D]`, causal masks
aligned bottom-right, plan before run, and in CUDA-graph mode a fixed batch size whose
indptr / indices / last_page_len live in the caller's buffers, which `run` reads (so a
replay that forgot to re-plan reads stale buffers, as the real kernel would). Attention is
computed per request in float64, then cast to the query dtype, with the plan's
`window_left` (a query sees itself and that many keys back; -1: all) and
`logits_soft_cap` (scores become cap * tanh(score / cap); 0 or None: as they are).

Each wrapper also keeps what it was built with (`init_kwargs`, the keywords besides the
workspace and layout, and `workspace_was_zero`), and its constructor takes exactly the
keywords FlashInfer 0.7.2's does, so a misspelt one fails here as it would there.

The decode wrapper also doubles the 0.7.2 internals the backend's fast graph replay reads
(`flashinfer_replay.WRAPPER_INTERNALS`), under the same names, and plans as 0.7.2 does:
copies into the graph buffers, then its module's `plan` (`fake_flashinfer_plan`) with the
same positional arguments, which writes a work partition into the pinned buffer and
"uploads" it into the int workspace. Its `run` checks that partition against the page
table it reads, so a replay whose plan saw other lengths than the buffers hold fails, as
the real kernels would go wrong.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

import torch

from tests.attention.fake_flashinfer_plan import (
    INT_WORKSPACE_BYTES,
    FakeDecodePlanModule,
    FakePrefillPlanModule,
    check_partition,
)

# What the backend's fast replay checks before it reads the internals doubled here.
FAKE_VERSION = "0.7.2.post1"


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, planned: dict):
    """q [n, H, D], k/v [S, Hkv, D] -> [n, H, D]; causal bottom-right: query j sits at
    S-n+j and sees keys up to it; a decode query (n = 1) sits at S-1."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * planned["scale"]
    cap = planned["soft_cap"]
    if cap:
        scores = cap * torch.tanh(scores / cap)
    n, s = q.shape[0], k.shape[0]
    keys, at = torch.arange(s)[None, :], torch.arange(n)[:, None] + (s - n)
    visible = keys <= at if causal else torch.ones(n, s, dtype=torch.bool)
    if planned["window_left"] >= 0:
        visible = visible & (keys >= at - planned["window_left"])
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class _PagedTable:
    """The CSR page table of a plan, read at run time (from graph buffers when given)."""

    def __init__(self, use_cuda_graph: bool, indptr_buf, indices_buf, last_buf) -> None:
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert indptr_buf is not None and indices_buf is not None and last_buf is not None
            self.fixed_bs = len(indptr_buf) - 1
            assert len(last_buf) == self.fixed_bs
        self.indptr, self.indices, self.last = indptr_buf, indices_buf, last_buf
        self.page_size = 0

    def set(self, indptr, indices, last, page_size: int) -> None:
        _check_int32(indptr=indptr, indices=indices, last_page_len=last)
        host_last = last.cpu()
        assert bool(((host_last >= 1) & (host_last <= page_size)).all()), host_last
        assert int(indptr.cpu()[-1]) == len(indices)
        self.page_size = page_size
        if self.use_cuda_graph:
            assert len(indptr) - 1 == self.fixed_bs, "batch size is fixed in cuda graph mode"
            self.indptr.copy_(indptr)
            self.indices[: len(indices)].copy_(indices)
            self.last.copy_(last)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last.clone()

    def kv(self, b: int, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return request_kv(self.indptr, self.indices, self.last, self.page_size, b, cache)


def request_kv(indptr, indices, last, page_size: int, b: int, cache) -> tuple[torch.Tensor, ...]:
    """Request b's K and V, [len, Hkv, D] each, read through a CSR page table."""
    k_cache, v_cache = cache
    assert k_cache.dim() == 4 and k_cache.shape[1] == page_size, "NHD paged cache"
    lo, hi = int(indptr[b]), int(indptr[b + 1])
    pages = indices[lo:hi].long()
    length = (hi - lo - 1) * page_size + int(last[b])
    return k_cache[pages].flatten(0, 1)[:length], v_cache[pages].flatten(0, 1)[:length]


# The `backend=` values FlashInfer 0.7.2's attention wrappers accept that matter here.
BACKENDS = ("auto", "fa2", "fa3")


class _Base:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **init_kwargs: Any):
        assert workspace.dtype == torch.uint8
        assert kv_layout == "NHD"
        assert init_kwargs.get("backend", "auto") in BACKENDS, init_kwargs
        self.init_kwargs = init_kwargs
        # FlashInfer: the float workspace "must be initialized to 0 for its first use".
        self.workspace_was_zero = bool((workspace == 0).all())
        self.planned: dict[str, Any] | None = None

    def _plan(self, num_qo_heads, num_kv_heads, head_dim, kw: dict[str, Any]) -> None:
        assert num_qo_heads % num_kv_heads == 0
        self.planned = {
            "heads": (num_qo_heads, num_kv_heads, head_dim),
            "scale": kw.get("sm_scale") or head_dim**-0.5,
            "q_dtype": kw["q_data_type"],
            "causal": kw.get("causal", False),
            "window_left": kw.get("window_left", -1),
            "soft_cap": kw.get("logits_soft_cap") or 0.0,
        }

    def _check_q(self, q: torch.Tensor) -> None:
        assert self.planned is not None, "plan() before run()"
        assert q.dtype == self.planned["q_dtype"], (q.dtype, self.planned["q_dtype"])
        assert tuple(q.shape[1:]) == (self.planned["heads"][0], self.planned["heads"][2])


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ) -> None:
        super().__init__(
            workspace,
            kv_layout,
            use_cuda_graph=use_cuda_graph,
            use_tensor_cores=use_tensor_cores,
            backend=backend,
        )
        # 0.7.2's internals, same names (its buffers are 8 MiB; small ones do here).
        self._float_workspace_buffer = workspace
        self._int_workspace_buffer = torch.zeros(
            INT_WORKSPACE_BYTES, dtype=torch.uint8, device=workspace.device
        )
        self._pin_memory_int_workspace_buffer = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8)
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        self._backend = backend
        self._jit_module = None
        self._plan_info = None
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_indices_buffer is not None
            assert paged_kv_last_page_len_buffer is not None
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self._fixed_batch_size + 1
        else:
            self._fixed_batch_size = 0
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self.page_size = 0
        self.full_plans = 0  # calls of plan(), for tests

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(self, indptr, indices, last_page_len, h, hkv, d, page_size, **kw) -> None:
        self.full_plans += 1
        _check_int32(indptr=indptr, indices=indices, last_page_len=last_page_len)
        host_last = last_page_len.cpu()
        assert bool(((host_last >= 1) & (host_last <= page_size)).all()), host_last
        assert int(indptr.cpu()[-1]) == len(indices)
        bs = len(last_page_len)
        device = self._float_workspace_buffer.device
        if self._use_cuda_graph:
            assert bs == self._fixed_batch_size, "batch size is fixed in cuda graph mode"
            assert len(indices) <= len(self._paged_kv_indices_buf)
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.to(device).clone()
            self._paged_kv_indices_buf = indices.to(device).clone()
            self._paged_kv_last_page_len_buf = last_page_len.to(device).clone()
        indptr_host = indptr.to("cpu")
        workspaces = (
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer,
        )
        graph = self._use_cuda_graph
        window_left = kw.get("window_left", -1)
        soft_cap = float(kw.get("logits_soft_cap") or 0.0)
        if self._use_tensor_cores:
            kv_lens = (indptr_host[1:] - indptr_host[:-1] - 1).clamp(min=0) * page_size
            kv_lens = (kv_lens + host_last).to(torch.int32)
            self._max_kv_len = int(kv_lens.max())
            self._cached_module = FakePrefillPlanModule()
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
            self._plan_info = self._cached_module.plan(
                *workspaces, qo_indptr, indptr_host, kv_lens, bs, bs, h, hkv, page_size, graph,
                d, d, False, window_left, -1, False, 0, 0,
            )  # fmt: skip
        else:
            self._cached_module = FakeDecodePlanModule()
            empty = torch.empty(0, dtype=kw["q_data_type"])
            self._plan_info = self._cached_module.plan(
                *workspaces, indptr_host, bs, h, hkv, page_size, graph, window_left, soft_cap,
                d, d, empty, empty,
            )  # fmt: skip
        self.page_size = page_size
        self._plan(h, hkv, d, kw)

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        self._check_q(q)
        table = (self._paged_kv_indptr_buf, self._paged_kv_indices_buf)
        table += (self._paged_kv_last_page_len_buf,)
        check_partition(self._int_workspace_buffer, table[0], q.shape[0])
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            k, v = request_kv(*table, self.page_size, b, paged_kv_cache)
            out[b] = _attend(q[b : b + 1], k, v, False, self.planned)[0].to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask=False,
    ) -> None:
        assert not use_cuda_graph, "the backend graphs decode only"
        super().__init__(workspace, kv_layout, backend=backend)
        self.table = _PagedTable(False, None, None, None)

    def plan(self, qo_indptr, indptr, indices, last_page_len, h, hkv, d, page_size, **kw):
        _check_int32(qo_indptr=qo_indptr)
        self.qo_indptr = qo_indptr.clone()
        self.table.set(indptr, indices, last_page_len, page_size)
        self._plan(h, hkv, d, kw)

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        self._check_q(q)
        out = torch.empty_like(q)
        for b in range(len(self.qo_indptr) - 1):
            lo, hi = int(self.qo_indptr[b]), int(self.qo_indptr[b + 1])
            k, v = self.table.kv(b, paged_kv_cache)
            att = _attend(q[lo:hi], k, v, self.planned["causal"], self.planned)
            out[lo:hi] = att.to(q.dtype)
        return out


class BatchPrefillWithRaggedKVCacheWrapper(_Base):
    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        kv_indptr_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask=False,
    ) -> None:
        assert not use_cuda_graph, "the backend graphs decode only"
        super().__init__(workspace, kv_layout, backend=backend)

    def plan(self, qo_indptr, kv_indptr, h, hkv, d, **kw) -> None:
        _check_int32(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        self.qo_indptr, self.kv_indptr = qo_indptr.clone(), kv_indptr.clone()
        self._plan(h, hkv, d, kw)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._check_q(q)
        out = torch.empty_like(q)
        for b in range(len(self.qo_indptr) - 1):
            lo, hi = int(self.qo_indptr[b]), int(self.qo_indptr[b + 1])
            klo, khi = int(self.kv_indptr[b]), int(self.kv_indptr[b + 1])
            att = _attend(q[lo:hi], k[klo:khi], v[klo:khi], self.planned["causal"], self.planned)
            out[lo:hi] = att.to(q.dtype)
        return out


def make_fake_flashinfer(version: str = FAKE_VERSION) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.__version__ = version
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    return module
