"""The CSR page table built with tensor ops, against a per-request Python reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attention.flashinfer_utils import (
    build_kv_indices,
    decode_use_tensor_cores,
    host_indptr,
    host_page_table,
)


def reference_csr(
    req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], page_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Every page_size-th slot of each request, as a page id; plain Python."""
    indptr, indices, last = [0], [], []
    for row, n in zip(rows, seq_lens, strict=True):
        for pos in range(0, n, page_size):
            indices.append(int(req_to_token[row, pos]) // page_size)
        indptr.append(len(indices))
        last.append(n - (len(range(0, n, page_size)) - 1) * page_size)
    return indptr, indices, last


def random_paged_table(
    rng: random.Random, num_rows: int, width: int, page_size: int, num_pages: int
) -> torch.Tensor:
    """req_to_token whose rows hold whole shuffled pages, offset i % page_size at position i."""
    free = list(range(1, num_pages))
    rng.shuffle(free)
    table = torch.zeros(num_rows, width, dtype=torch.int32)
    for row in range(num_rows):
        for p in range(width // page_size):
            page = free.pop() if free else rng.randrange(1, num_pages)
            table[row, p * page_size : (p + 1) * page_size] = torch.arange(
                page * page_size, (page + 1) * page_size, dtype=torch.int32
            )
    return table


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(5))
def test_csr_matches_python_reference(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    width = 64 if page_size == 1 else 256
    table = random_paged_table(rng, 12, width, page_size, 4096)
    batch = rng.randint(1, 12)
    rows = rng.sample(range(12), batch)  # rows out of order, ragged lengths incl. 1
    seq_lens = [rng.choice([1, page_size, page_size + 1, rng.randint(1, width)]) for _ in rows]
    ref_indptr, ref_indices, ref_last = reference_csr(table, rows, seq_lens, page_size)

    rows_t = torch.tensor(rows, dtype=torch.int64)
    lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    for total in (None, ref_indptr[-1]):  # with and without the host-known total
        indptr, indices, last = build_kv_indices(table, rows_t, lens_t, page_size, total)
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert indptr.tolist() == ref_indptr
        assert indices.tolist() == ref_indices
        assert last.tolist() == ref_last

    host_ptr, host_last, total = host_page_table(seq_lens, page_size)
    assert host_ptr.dtype == host_last.dtype == torch.int32
    assert host_ptr.tolist() == ref_indptr and host_last.tolist() == ref_last
    assert total == ref_indptr[-1]


def test_csr_single_token_pages_are_slots() -> None:
    table = torch.tensor([[5, 9, 2, 0], [7, 3, 0, 0]], dtype=torch.int32)
    indptr, indices, last = build_kv_indices(
        table, torch.tensor([1, 0]), torch.tensor([2, 3]), page_size=1
    )
    assert indptr.tolist() == [0, 2, 5]
    assert indices.tolist() == [7, 3, 5, 9, 2]
    assert last.tolist() == [1, 1]


def test_host_indptr() -> None:
    assert host_indptr([3, 1, 4]).tolist() == [0, 3, 4, 8]
    assert host_indptr([]).tolist() == [0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "expected"), [(32, 8, True), (16, 4, True), (16, 8, False), (9, 3, False)]
)
def test_decode_tensor_cores_for_large_gqa_groups(heads: int, kv_heads: int, expected: bool):
    assert decode_use_tensor_cores(heads, kv_heads) is expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_csr_written_in_place_into_caller_buffers(page_size: int) -> None:
    """out=: the graph's persistent buffers are filled, nothing else is returned; a longer
    indices buffer keeps its tail; seq_lens_cpu may be a list or an int64 array."""
    rng = random.Random(page_size)
    table = random_paged_table(rng, 8, 256, page_size, 4096)
    rows, seq_lens = [3, 0, 7, 0], [1, page_size + 1, 200, 1]  # two padding-like rows
    ref_indptr, ref_indices, ref_last = reference_csr(table, rows, seq_lens, page_size)
    indptr_buf = torch.zeros(9, dtype=torch.int32)
    indices_buf = torch.full((1000,), -7, dtype=torch.int32)
    last_buf = torch.ones(8, dtype=torch.int32)
    out = (indptr_buf[:5], indices_buf, last_buf[:4])
    total = host_page_table(np.array(seq_lens, dtype=np.int64), page_size)[2]
    got = build_kv_indices(
        table, torch.tensor(rows), torch.tensor(seq_lens), page_size, total, out=out
    )
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in out]
    assert indptr_buf[:5].tolist() == ref_indptr and last_buf[:4].tolist() == ref_last
    assert indices_buf[:total].tolist() == ref_indices
    assert bool((indices_buf[total:] == -7).all()) and bool((last_buf[4:] == 1).all())


def test_host_tables_of_an_empty_batch() -> None:
    indptr, last, total = host_page_table([], 16)
    assert indptr.tolist() == [0] and last.tolist() == [] and total == 0
