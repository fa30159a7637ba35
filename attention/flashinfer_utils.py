"""Paged-KV page tables in FlashInfer's CSR form, built with tensor ops (no flashinfer import).

FlashInfer describes each request's KV as a list of pages: `kv_indptr[b] .. kv_indptr[b+1]`
index `kv_indices`, the page ids of request b in order, and `kv_last_page_len[b]` (1 ..
page_size) says how many slots of its last page hold tokens. Our pool stores slot
`page * page_size + offset` at row `slot` of a `[num_slots, Hkv, D]` buffer, so the paged
view FlashInfer reads is `buffer.view(-1, page_size, Hkv, D)` ("NHD") and a request's page
ids are `req_to_token[row, p * page_size] // page_size` for p = 0, 1, ... (the allocator
hands out whole pages and a request's token at position i sits at offset i % page_size).

`build_kv_indices` runs on the device of `req_to_token` with no per-request Python loop and
no device -> host copy when `total_pages` is given; `host_page_table` derives the same
indptr / last_page_len on the host from `seq_lens_cpu`, which is what FlashInfer's plan step
wants (it copies them to the device itself; a device indptr would cost a sync).
"""

from __future__ import annotations

import torch

# GQA group size from which decode runs FlashInfer's tensor-core (prefill) kernels: with a
# group of 4+ query heads per KV head the tensor-core path wins (SGLang uses the same cut).
TENSOR_CORE_MIN_GROUP = 4


def num_pages(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def host_page_table(seq_lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indptr int32 [B+1], kv_last_page_len int32 [B], total pages), on the host."""
    pages = [num_pages(n, page_size) for n in seq_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, pages, strict=True)]
    return (
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32),
        indptr[-1],
    )


def host_indptr(lens: list[int]) -> torch.Tensor:
    """Exclusive prefix sum of `lens` as an int32 [B+1] host tensor (qo / ragged kv indptr)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CSR page table of a batch, on `req_to_token`'s device.

    req_to_token int32 [rows, max_context_len]; req_pool_indices [B] (rows of the batch);
    seq_lens [B] (tokens with KV, >= 1). Returns (kv_indptr int32 [B+1], kv_indices int32
    [total_pages], kv_last_page_len int32 [B]). `total_pages` (the sum of ceil(seq_len /
    page_size), known on the host from seq_lens_cpu) avoids a device -> host sync.
    """
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = req_pool_indices.to(device=device, dtype=torch.int64)
    pages = (seq_lens + page_size - 1) // page_size
    indptr = torch.zeros(pages.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(pages, dim=0, out=indptr[1:])
    if total_pages is None:
        total_pages = int(indptr[-1])
    # Entry j of kv_indices belongs to request r(j), page j - indptr[r(j)] of it.
    owner = torch.repeat_interleave(
        torch.arange(pages.numel(), device=device), pages, output_size=total_pages
    )
    page_in_req = torch.arange(total_pages, device=device) - indptr[owner]
    first_slots = req_to_token[rows[owner], page_in_req * page_size]
    kv_indices = (first_slots // page_size).to(torch.int32)
    last_page_len = (seq_lens - (pages - 1) * page_size).to(torch.int32)
    return indptr.to(torch.int32), kv_indices, last_page_len


def decode_use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Use FlashInfer's tensor-core decode for GQA groups of TENSOR_CORE_MIN_GROUP or more."""
    return num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
