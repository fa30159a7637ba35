"""A pure-torch stand-in for the three flashinfer wrappers the backend uses, for CPU tests.

It implements FlashInfer's documented contract, strictly: int32 CSR tensors, 1 <=
last_page_len <= page_size, "NHD" paged caches `[pages, page_size, Hkv, D]`, causal masks
aligned bottom-right, plan before run, and in CUDA-graph mode a fixed batch size whose
indptr / indices / last_page_len live in the caller's buffers, which `run` reads (so a
replay that forgot to re-plan reads stale buffers, as the real kernel would). Attention is
computed per request in float64, then cast to the query dtype.

Each wrapper also keeps what it was built with (`init_kwargs`, the keywords besides the
workspace and layout, and `workspace_was_zero`), and its constructor takes exactly the
keywords FlashInfer 0.7.2's does, so a misspelt one fails here as it would there.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

import torch


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q [n, H, D], k/v [S, Hkv, D] -> [n, H, D]; causal bottom-right: query j sees S-n+j."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        n, s = q.shape[0], k.shape[0]
        visible = torch.arange(s)[None, :] <= torch.arange(n)[:, None] + (s - n)
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
        k_cache, v_cache = cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == self.page_size, "NHD paged cache"
        lo, hi = int(self.indptr[b]), int(self.indptr[b + 1])
        pages = self.indices[lo:hi].long()
        length = (hi - lo - 1) * self.page_size + int(self.last[b])
        k = k_cache[pages].flatten(0, 1)[:length]
        v = v_cache[pages].flatten(0, 1)[:length]
        return k, v


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
        self.use_tensor_cores = use_tensor_cores
        self.table = _PagedTable(
            use_cuda_graph,
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )

    def plan(self, indptr, indices, last_page_len, h, hkv, d, page_size, **kw) -> None:
        self.table.set(indptr, indices, last_page_len, page_size)
        self._plan(h, hkv, d, kw)

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        self._check_q(q)
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            k, v = self.table.kv(b, paged_kv_cache)
            out[b] = _attend(q[b : b + 1], k, v, False, self.planned["scale"])[0].to(q.dtype)
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
            att = _attend(q[lo:hi], k, v, self.planned["causal"], self.planned["scale"])
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
            att = _attend(
                q[lo:hi], k[klo:khi], v[klo:khi], self.planned["causal"], self.planned["scale"]
            )
            out[lo:hi] = att.to(q.dtype)
        return out


def make_fake_flashinfer() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    return module
