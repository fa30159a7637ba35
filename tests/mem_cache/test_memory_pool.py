from __future__ import annotations

import torch

from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from tests.conftest import rss_bytes


def test_req_to_token_pool() -> None:
    p = ReqToTokenPool(3, 16)
    assert p.req_to_token.shape == (3, 16) and p.req_to_token.dtype == torch.int32
    rows = p.alloc(2)
    assert rows is not None and len(set(rows)) == 2 and p.available_size() == 1
    assert p.alloc(2) is None and p.available_size() == 1
    p.free(rows[0])
    p.free([rows[1]])
    assert p.available_size() == 3
    p.alloc(3)
    p.clear()
    assert sorted(p.alloc(3) or []) == [0, 1, 2]


def test_kv_pool_shapes_and_dummy_page() -> None:
    pool = MHATokenToKVPool(18, 4, torch.float16, head_num=2, head_dim=8, layer_num=3)
    assert pool.size == 16
    assert len(pool.k_buffer) == 3 and len(pool.v_buffer) == 3
    assert pool.get_key_buffer(0).shape == (20, 2, 8)
    assert pool.get_value_buffer(2).dtype == torch.float16
    assert pool.get_kv_size_bytes() == 2 * 3 * 20 * 2 * 8 * 2


def test_kv_pool_set_get_casts() -> None:
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, head_num=2, head_dim=4, layer_num=2)
    loc = torch.tensor([3, 5], dtype=torch.int64)
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    torch.testing.assert_close(kb[loc].float(), k.to(torch.bfloat16).float())
    torch.testing.assert_close(vb[loc].float(), v.to(torch.bfloat16).float())
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layer untouched
    assert kb[0].abs().sum() == 0 and kb[4].abs().sum() == 0


def test_cpu_kv_pool_reads_zeros_and_is_backed_only_where_written() -> None:
    """A CPU pool of 2 x 8 x 4 MiB reads as zeros and takes (almost) no resident memory until
    its slots are written: the server does not write gigabytes of zeros at start."""
    before = rss_bytes()
    assert before is not None, "this test reads /proc/self/statm"
    pool = MHATokenToKVPool(
        size=16384, page_size=1, dtype=torch.float32, head_num=4, head_dim=16, layer_num=8
    )
    after = rss_bytes()
    assert after is not None
    grown = after - before
    assert pool.get_kv_size_bytes() >= 64 << 20
    assert grown < 16 << 20, f"the pool's allocation made {grown} bytes resident"
    k, v = pool.get_kv_buffer(3)
    assert k.shape == (16385, 4, 16) and k.is_contiguous() and not k.any() and not v.any()
    loc = torch.tensor([5, 9])
    pool.set_kv_buffer(3, loc, torch.ones(2, 4, 16), torch.full((2, 4, 16), 2.0))
    assert k[loc].eq(1).all() and v[loc].eq(2).all() and k.sum() == 128
    assert not pool.get_key_buffer(2).any()  # buffers are distinct mappings
