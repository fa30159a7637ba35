"""Doubles of FlashInfer 0.7.2's fa2 plan modules (`wrapper._cached_module`), for CPU tests.

Their `plan` takes exactly the positional arguments of the 0.7.2 C++ plan functions
(`BatchDecodeWithPagedKVCachePlan`, and `BatchPrefillWithKVCachePlan` that tensor-core
decode goes through) and checks what the C++ side needs: host int32 indptrs, a host uint8
pinned buffer, device workspaces. Like the real scheduler it writes a work partition into
the pinned buffer (here: each request's page count, from the host indptr), "uploads" it
into the int workspace, and returns plan info that under CUDA graphs depends on the batch
size alone (and here also names the window it was planned with, so a replay that planned
another window than its capture differs). `check_partition` is what a kernel launch sees:
the uploaded partition must describe the page table it reads.
"""

from __future__ import annotations

import numpy as np
import torch

INT_WORKSPACE_BYTES = 4096


def _check_host_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor), (name, type(t))
        assert t.device.type == "cpu" and t.dtype == torch.int32, (name, t.device, t.dtype)
        assert t.is_contiguous(), name


def _check_workspaces(float_ws, int_ws, pinned) -> None:
    assert float_ws.dtype == int_ws.dtype == pinned.dtype == torch.uint8
    assert int_ws.device == float_ws.device and pinned.device.type == "cpu"


def _upload_partition(int_ws, pinned, indptr: torch.Tensor, batch_size: int) -> None:
    assert len(indptr) == batch_size + 1
    pages = torch.from_numpy(np.diff(indptr.numpy()).astype(np.int32))
    pinned.view(torch.int32)[:batch_size] = pages  # the host writes the pinned buffer
    int_ws.view(torch.int32)[:batch_size].copy_(pinned.view(torch.int32)[:batch_size])


def check_partition(int_ws: torch.Tensor, indptr_buf: torch.Tensor, batch_size: int) -> None:
    planned = int_ws.view(torch.int32)[:batch_size].cpu()
    actual = (indptr_buf[1 : batch_size + 1] - indptr_buf[:batch_size]).cpu()
    assert torch.equal(planned, actual), f"stale plan: planned pages {planned}, table {actual}"


class FakeDecodePlanModule:
    def __init__(self) -> None:
        self.calls = 0

    def plan(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        page_locked_int_workspace_buffer: torch.Tensor,
        indptr: torch.Tensor,
        batch_size: int,
        num_qo_heads: int,
        num_kv_heads: int,
        page_size: int,
        enable_cuda_graph: bool,
        window_left: int,
        logits_soft_cap: float,
        head_dim_qk: int,
        head_dim_vo: int,
        empty_q_data: torch.Tensor,
        empty_kv_data: torch.Tensor,
    ) -> list[int]:
        self.calls += 1
        pinned = page_locked_int_workspace_buffer
        _check_workspaces(float_workspace_buffer, int_workspace_buffer, pinned)
        _check_host_int32(indptr=indptr)
        assert isinstance(enable_cuda_graph, bool)
        assert isinstance(window_left, int) and window_left >= -1
        assert isinstance(logits_soft_cap, float) and logits_soft_cap >= 0.0
        assert head_dim_qk == head_dim_vo
        assert num_qo_heads % num_kv_heads == 0 and page_size >= 1
        assert empty_q_data.numel() == empty_kv_data.numel() == 0
        assert empty_q_data.dtype in (torch.float16, torch.bfloat16)
        _upload_partition(int_workspace_buffer, pinned, indptr, batch_size)
        return [batch_size, 0, 16, 32, 48, 64, 80, 96, int(enable_cuda_graph), 1, window_left]


class FakePrefillPlanModule:
    def __init__(self) -> None:
        self.calls = 0

    def plan(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer: torch.Tensor,
        page_locked_int_workspace_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_len_arr: torch.Tensor,
        total_num_rows: int,
        batch_size: int,
        num_qo_heads: int,
        num_kv_heads: int,
        page_size: int,
        enable_cuda_graph: bool,
        head_dim_qk: int,
        head_dim_vo: int,
        causal: bool,
        window_left: int,
        fixed_split_size: int,
        disable_split_kv: bool,
        num_colocated_ctas: int = 0,
        uniform_q_len: int = 0,
    ) -> list[int]:
        self.calls += 1
        pinned = page_locked_int_workspace_buffer
        _check_workspaces(float_workspace_buffer, int_workspace_buffer, pinned)
        _check_host_int32(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_len_arr=kv_len_arr)
        assert torch.equal(qo_indptr, torch.arange(batch_size + 1, dtype=torch.int32))
        assert total_num_rows == batch_size and len(kv_len_arr) == batch_size
        assert isinstance(enable_cuda_graph, bool) and causal is False
        assert isinstance(window_left, int) and window_left >= -1
        assert fixed_split_size == -1 and disable_split_kv is False
        assert num_colocated_ctas == 0 and uniform_q_len == 0
        assert num_qo_heads % num_kv_heads == 0 and head_dim_qk == head_dim_vo
        # kv_len_arr must agree with the page table (FlashInfer derives it from indptr).
        pages = np.diff(kv_indptr.numpy())
        lens = kv_len_arr.numpy()
        assert ((lens > (pages - 1) * page_size) & (lens <= pages * page_size)).all()
        _upload_partition(int_workspace_buffer, pinned, kv_indptr, batch_size)
        info = [batch_size, batch_size, 0, 16, 32, 48, 64, 80, 96, 112, 0, 0, 128, 1, 1]
        return [*info, window_left]
