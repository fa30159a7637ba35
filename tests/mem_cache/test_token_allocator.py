from __future__ import annotations

import time

import pytest
import torch

from mem_cache.allocator import TokenToKVPoolAllocator


def _all_pages(alloc: TokenToKVPoolAllocator) -> list[int]:
    return sorted(alloc.free_pages().tolist())


def test_page1_alloc_free_exhaustion() -> None:
    a = TokenToKVPoolAllocator(10, page_size=1)
    assert a.total_size() == 10 and a.available_size() == 10
    x = a.alloc(4)
    assert x is not None and x.dtype == torch.int64 and len(x) == 4
    assert 0 not in x.tolist()  # the dummy slot is never handed out
    y = a.alloc(6)
    assert y is not None and set(x.tolist()).isdisjoint(y.tolist())
    assert a.available_size() == 0
    assert a.alloc(1) is None
    a.free(x)
    assert a.available_size() == 4
    assert a.alloc(5) is None and a.available_size() == 4  # failed alloc takes nothing
    a.free(torch.empty(0, dtype=torch.int64))
    a.free(y)
    assert _all_pages(a) == list(range(1, 11))


def test_alloc_zero_and_clear() -> None:
    a = TokenToKVPoolAllocator(8)
    z = a.alloc(0)
    assert z is not None and len(z) == 0
    a.alloc(5)
    a.clear()
    assert a.available_size() == 8


def test_alloc_asserts_page_size_one() -> None:
    with pytest.raises(AssertionError):
        TokenToKVPoolAllocator(16, page_size=4).alloc(4)


def test_size_rounds_down_to_pages() -> None:
    a = TokenToKVPoolAllocator(18, page_size=4)
    assert a.num_pages == 4 and a.total_size() == 16
    assert _all_pages(a) == [1, 2, 3, 4]


def test_page1_extend_and_decode_degenerate() -> None:
    a = TokenToKVPoolAllocator(16)
    x = a.alloc_extend([0, 3], [5, 4], [0, 7])
    assert x is not None and len(x) == 6
    d = a.alloc_decode([6, 5], [1, 2])
    assert d is not None and len(d) == 2
    assert a.available_size() == 8


def test_paged_extend_from_empty_prefix() -> None:
    a = TokenToKVPoolAllocator(32, page_size=4)
    x = a.alloc_extend([0], [6], [0])
    assert x is not None
    pages = (x // 4).tolist()
    assert pages[:4] == [pages[0]] * 4 and pages[4:] == [pages[4]] * 2 and pages[0] != pages[4]
    assert (x % 4).tolist() == [0, 1, 2, 3, 0, 1]
    assert a.available_size() == 32 - 8


def test_paged_extend_reuses_partial_last_page() -> None:
    a = TokenToKVPoolAllocator(32, page_size=4)
    first = a.alloc_extend([0], [6], [0])
    assert first is not None
    last_loc = int(first[-1])  # position 5 at offset 1 of its page
    before = a.available_size()
    x = a.alloc_extend([6], [11], [last_loc])
    assert x is not None
    # positions 6, 7 fill the partial page; 8, 9, 10 go to one fresh page
    assert x[:2].tolist() == [last_loc + 1, last_loc + 2]
    assert (x[2:] // 4).unique().numel() == 1 and (x[2:] % 4).tolist() == [0, 1, 2]
    assert before - a.available_size() == 4
    # small extend entirely inside the partial page takes no page
    y = a.alloc_extend([11], [12], [int(x[-1])])
    assert y is not None and y.tolist() == [int(x[-1]) + 1]
    assert before - a.available_size() == 4


def test_paged_extend_aligned_prefix_takes_fresh_pages() -> None:
    a = TokenToKVPoolAllocator(32, page_size=4)
    x = a.alloc_extend([4, 8], [5, 13], [99, 123])
    assert x is not None and len(x) == 6
    assert int(x[0]) % 4 == 0 and (x[1:] % 4).tolist() == [0, 1, 2, 3, 0]
    assert a.available_size() == 32 - 3 * 4


def test_paged_extend_not_enough_allocates_nothing() -> None:
    a = TokenToKVPoolAllocator(16, page_size=4)
    assert a.alloc_extend([0, 0], [8, 9], [0, 0]) is None
    assert a.available_size() == 16


def test_paged_decode() -> None:
    a = TokenToKVPoolAllocator(16, page_size=4)
    x = a.alloc_extend([0, 0], [4, 2], [0, 0])
    assert x is not None
    # req0 has 4 tokens (full page): its 5th needs a new page; req1 continues its page
    d = a.alloc_decode([5, 3], [int(x[3]), int(x[5])])
    assert d is not None
    assert int(d[0]) % 4 == 0 and int(d[0]) // 4 not in (x // 4).tolist()
    assert int(d[1]) == int(x[5]) + 1
    assert a.available_size() == 4
    assert a.alloc_decode([9], [int(d[0]) + 3]) is not None  # hypothetical: takes last page
    assert a.alloc_decode([13], [0]) is None


def test_paged_free_returns_whole_pages_deduped() -> None:
    a = TokenToKVPoolAllocator(16, page_size=4)
    x = a.alloc_extend([0], [6], [0])
    assert x is not None
    a.free(x)  # 6 slots on 2 pages -> 2 pages back, once each
    assert _all_pages(a) == [1, 2, 3, 4]


def test_free_group_batches() -> None:
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(6)
    assert x is not None
    a.free_group_begin()
    a.free(x[:2])
    a.free(x[2:])
    assert a.available_size() == 2  # nothing released inside the group
    a.free_group_end()
    assert a.available_size() == 8
    a.free_group_end()  # an empty group is a no-op
    assert a.available_size() == 8


def test_decode_alloc_is_fast() -> None:
    a = TokenToKVPoolAllocator(1 << 16)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        x = a.alloc(64)
        assert x is not None
        a.free(x)
    per_pair = (time.perf_counter() - start) / n
    # Typically a few microseconds; the bound is loose so a loaded CI box does not flake.
    assert per_pair < 500e-6, per_pair
