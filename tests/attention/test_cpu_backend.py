"""The cpu backend (compiled paged decode and extend kernels) against a float64 reference and
torch_native."""

from __future__ import annotations

import logging

import pytest
import torch

from attention import cpu_backend, create_attention_backend
from attention.cpu_backend import CpuAttnBackend
from attention.registry import resolve_attention_backend
from attention.torch_native_backend import TorchNativeAttnBackend
from srt.kernels import attention as kernels
from srt.model_executor.forward_batch import ForwardMode
from tests.attention.test_torch_native_backend import TOL, Harness, reference_attention

KERNEL = kernels.paged_decode_kernel()
EXTEND_KERNEL = kernels.paged_extend_kernel()
needs_kernel = pytest.mark.skipif(
    KERNEL is None or EXTEND_KERNEL is None, reason="no C compiler: the kernels cannot build"
)


def cpu_harness(
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    head_dim: int = 64,
    window: int | None = None,
    logit_cap: float | None = None,
    **kw,
):
    backend = CpuAttnBackend(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        sliding_window=window,
    )
    return Harness(
        num_heads,
        num_kv_heads,
        dtype,
        head_dim=head_dim,
        window=window,
        logit_cap=logit_cap,
        backend=backend,
        **kw,
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 1, 64), (14, 2, 64), (8, 2, 128), (3, 3, 128)],
)
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Every specialised (query group, head dim) shape, ragged lengths, rows out of order."""
    h = cpu_harness(num_heads, num_kv_heads, dtype, head_dim, max_context_len=1024)
    assert h.builder.backend.uses_kernel
    # Eight requests (one work item each, no split): request 3's 540 tokens span 17 tiles
    # of the online softmax (TILE = 32 in csrc/paged_decode.c), the last one partial.
    lens = [3, 17, 1, 540, 2, 9, 30, 4]
    h.step(list(enumerate(lens)))
    for _ in range(3):
        assert h.step([(rid, 1) for rid in range(len(lens))]) < TOL[dtype]
    assert h.step([(3, 1), (1, 1)]) < TOL[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequence_split_over_threads(dtype):
    """One long request is split into ranges (one per thread and more) that are merged."""
    h = cpu_harness(6, 2, dtype, num_slots=4096, max_context_len=2048)
    h.step([(0, 1500)])
    assert h.step([(0, 1)]) < TOL[dtype]
    h.step([(1, 700), (2, 5)])
    assert h.step([(0, 1), (1, 1), (2, 1)]) < TOL[dtype]


def shared_prefix_batch(dtype, num_heads, num_kv_heads, head_dim, tails, prefixes):
    """A pool and req_to_token where requests share leading KV slots, as the radix cache
    leaves them: request i reads prefix `prefixes[i]` = (group, length) of its group's slots,
    then `tails[i]` slots of its own. Pool rows are assigned out of order."""
    gen = torch.Generator().manual_seed(7)
    group_slots: dict[int, torch.Tensor] = {}
    next_slot, rows = 1, []
    for (group, length), tail in zip(prefixes, tails, strict=True):
        if group not in group_slots:
            group_slots[group] = torch.arange(next_slot, next_slot + 600, dtype=torch.int32)
            next_slot += 600
        own = torch.arange(next_slot, next_slot + tail, dtype=torch.int32)
        next_slot += tail
        rows.append(torch.cat([group_slots[group][:length], own]))
    batch = len(rows)
    pool_rows = torch.randperm(batch + 3, generator=gen)[:batch]
    req_to_token = torch.zeros(batch + 3, 1024, dtype=torch.int32)
    for b, row in enumerate(rows):
        req_to_token[pool_rows[b], : len(row)] = row
    k_cache = torch.randn(next_slot, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(next_slot, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads * head_dim, generator=gen)
    seq_lens = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    return q, k_cache, v_cache, req_to_token, pool_rows, seq_lens, rows


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_decode_over_shared_prefix_slots(dtype, num_heads, num_kv_heads, head_dim):
    """Rows laid out as the radix cache leaves them: requests whose leading KV slots are the
    same slots (groups of three over 300 tokens, one member's whole row; of two over 40; a
    pair over 10), a request alone and an empty row, pool rows out of order. Each output
    equals the float64 reference over that request's own slots."""
    prefixes = [(0, 300), (1, 40), (0, 300), (2, 10), (3, 0), (1, 40), (2, 10), (0, 300), (4, 0)]
    tails = [1, 5, 20, 3, 130, 300, 1, 0, 0]
    q, k_cache, v_cache, r2t, pool_rows, seq_lens, rows = shared_prefix_batch(
        dtype, num_heads, num_kv_heads, head_dim, tails, prefixes
    )
    scale = head_dim**-0.5
    shared = kernels.shared_prefixes(r2t, pool_rows, seq_lens, min_tokens=1)
    # Found: the three groups, each member's common prefix; the last token of the shortest
    # member (300 group slots and nothing of its own) stays out of its group's prefix.
    assert shared.leaders.tolist() == [0, 1, 0, 3, 4, 1, 3, 0, 8]
    assert shared.lens.tolist() == [299, 40, 299, 10, 0, 40, 10, 299, 0]
    assert shared.groups == 3
    for plan in (None, shared):
        out = KERNEL(q, k_cache, v_cache, r2t, pool_rows, seq_lens, num_heads, scale, plan)
        for b, row in enumerate(rows):
            got = out[b].view(num_heads, head_dim).double()
            if len(row) == 0:
                assert (got == 0).all()
                continue
            k, v = k_cache[row.long()], v_cache[row.long()]
            ref = reference_attention(q[b].view(1, num_heads, head_dim), k, v, len(row) - 1, scale)
            assert (got - ref[0]).abs().max().item() < 1e-5, (plan is None, b)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128)])
def test_decode_shared_group_of_many_members(dtype, num_heads, num_kv_heads, head_dim):
    """A group of 25 members over a 270-token prefix (two chunks, the second partial) and a
    pair over 70: each member's output equals the float64 reference over its own slots."""
    prefixes = [(0, 270)] * 25 + [(1, 70)] * 2
    tails = [(3 * i) % 11 + 1 for i in range(27)]
    q, k_cache, v_cache, r2t, pool_rows, seq_lens, rows = shared_prefix_batch(
        dtype, num_heads, num_kv_heads, head_dim, tails, prefixes
    )
    scale = head_dim**-0.5
    shared = kernels.shared_prefixes(r2t, pool_rows, seq_lens)
    assert shared.groups == 2 and shared.lens.tolist() == [270] * 25 + [70] * 2
    out = KERNEL(q, k_cache, v_cache, r2t, pool_rows, seq_lens, num_heads, scale, shared)
    for b, row in enumerate(rows):
        got = out[b].view(num_heads, head_dim).double()
        k, v = k_cache[row.long()], v_cache[row.long()]
        ref = reference_attention(q[b].view(1, num_heads, head_dim), k, v, len(row) - 1, scale)
        assert (got - ref[0]).abs().max().item() < 1e-5, b


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_sliding_window_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Both kernels under a window beside a full layer: prompts shorter and longer than it,
    blocks of 32 queries straddling its edge, an extend over a cached prefix far past it,
    decodes long enough to be split over threads, and requests that share a prefix (read
    once by the full layer, each on its own by the windowed one)."""
    window = 40
    h = cpu_harness(num_heads, num_kv_heads, dtype, head_dim, window, max_context_len=2048)
    assert h.builder.backend.uses_kernel and h.builder.backend.uses_extend_kernel
    assert h.step([(0, 5), (1, 100), (2, 1), (3, 1200)]) < TOL[dtype]
    assert h.step([(0, 70), (1, 3), (3, 33)]) < TOL[dtype]
    h.fork(3, 4)
    h.fork(3, 5)
    assert h.step([(4, 20), (5, 1)]) < TOL[dtype]
    for _ in range(2):
        assert h.step([(rid, 1) for rid in range(6)]) < TOL[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_match_reference(dtype):
    """Both kernels with Gemma 2's soft-capping on a windowed layer; a cap of 1 where the
    scores' spread is about 1, so that it bites."""
    h = cpu_harness(8, 2, dtype, 64, window=50, logit_cap=1.0, max_context_len=1024)
    assert h.step([(0, 300), (1, 7)]) < TOL[dtype]
    assert h.step([(0, 40), (1, 1)]) < TOL[dtype]
    for _ in range(2):
        assert h.step([(0, 1), (1, 1)]) < TOL[dtype]


def test_shared_prefixes_planner_thresholds():
    """Prefixes shorter than the threshold are not grouped; a lone request and a batch of one
    plan nothing; a group whose members diverge after 100 slots shares exactly those 100."""
    prefixes = [(0, 100), (0, 100), (1, 30), (1, 30), (2, 0)]
    q, k_cache, v_cache, r2t, pool_rows, seq_lens, _ = shared_prefix_batch(
        torch.float32, 9, 3, 64, [50, 7, 9, 9, 200], prefixes
    )
    shared = kernels.shared_prefixes(r2t, pool_rows, seq_lens)  # default: 64 tokens
    assert shared.lens.tolist() == [100, 100, 0, 0, 0]
    assert shared.leaders.tolist() == [0, 0, 2, 3, 4]
    assert kernels.shared_prefixes(r2t, pool_rows[2:], seq_lens[2:]) is None
    assert kernels.shared_prefixes(r2t, pool_rows[:1], seq_lens[:1]) is None
    out = KERNEL(q, k_cache, v_cache, r2t, pool_rows, seq_lens, 9, 0.125, shared)
    plain = KERNEL(q, k_cache, v_cache, r2t, pool_rows, seq_lens, 9, 0.125)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_step_plans_shared_prefixes_once(monkeypatch):
    """The backend plans the shared prefixes of a decode batch once per step (not per layer),
    from the pool's req_to_token: requests extended from one cached prefix share its slots,
    and both layers' outputs still equal the reference."""
    plans = []

    def recording(*args, **kwargs):  # a spy around the real planner
        plans.append(kernels.shared_prefixes(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(cpu_backend, "shared_prefixes", recording)
    h = cpu_harness(9, 3, torch.float32)
    h.step([(0, 200)])
    h.fork(0, 1)  # requests 1 and 2 hold request 0's 200 slots, as radix-cache hits do
    h.fork(0, 2)
    h.step([(1, 5), (2, 70)])
    assert plans == []  # extend batches plan nothing
    for _ in range(2):
        assert h.step([(0, 1), (1, 1), (2, 1)]) < TOL[torch.float32]
    assert len(plans) == 2  # one per decode step, for both layers
    assert plans[0].leaders.tolist() == [0, 0, 0] and plans[0].lens.tolist() == [200] * 3


@needs_kernel
def test_page_size_16_and_mixed_batches():
    h = cpu_harness(9, 3, torch.float32, page_size=16)
    h.step([(0, 40), (1, 3)])
    assert h.step([(0, 1), (1, 1)]) < TOL[torch.float32]
    mixed = [(0, 1), (1, 6), (2, 20)]  # a decode token and two extends, one extend call
    assert h.step(mixed, mode=ForwardMode.MIXED) < TOL[torch.float32]
    assert h.step([(0, 1), (1, 1), (2, 1)]) < TOL[torch.float32]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_torch_native(dtype):
    """Same pool, same batch: the kernel's output equals torch_native's to rounding."""
    gen = torch.Generator().manual_seed(7)
    h = cpu_harness(9, 3, dtype)
    h.step([(i, 30 + 37 * i) for i in range(6)])
    batch = h.builder.build([(i, [0]) for i in range(6)])
    q = torch.randn(6, 9 * 64, generator=gen).to(dtype)
    k = torch.randn(6, 3 * 64, generator=gen).to(dtype)
    v = torch.randn(6, 3 * 64, generator=gen).to(dtype)
    layer = h.layers[0]
    got = layer(q, k, v, batch)
    native = TorchNativeAttnBackend()
    batch.attn_backend = native
    native.init_forward_metadata(batch)
    want = layer(q, k, v, batch)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
def test_unsupported_shapes_fall_back_to_torch(caplog):
    """A head dim or query group a kernel is not built for runs through torch_native."""
    for heads, kv_heads, head_dim in [(4, 2, 16), (18, 1, 64)]:
        with caplog.at_level(logging.WARNING, logger="attention.cpu_backend"):
            h = cpu_harness(heads, kv_heads, torch.float32, head_dim)
        assert not h.builder.backend.uses_kernel
        assert "decode uses the torch path" in caplog.text
        # The extend kernel takes any query group; head dim 16 is not one it is built for.
        assert h.builder.backend.uses_extend_kernel == (head_dim == 64)
        h.step([(0, 5), (1, 9)])
        assert h.step([(0, 1), (1, 1)]) < TOL[torch.float32]
        caplog.clear()


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """No usable compiler: the kernels are None with the reason logged; both modes still work."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither gcc nor cc on PATH
    loaders = (kernels.paged_decode_kernel, kernels.paged_extend_kernel)
    for load in loaders:
        load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="srt.kernels.build"):
            assert all(load() is None for load in loaders)
        assert "no C compiler" in caplog.text
        h = cpu_harness(9, 3, torch.float32)
        assert not h.builder.backend.uses_kernel
        assert not h.builder.backend.uses_extend_kernel
        assert h.step([(0, 5)]) < TOL[torch.float32]
        assert h.step([(0, 1)]) < TOL[torch.float32]
    finally:
        for load in loaders:
            load.cache_clear()


def test_auto_picks_cpu_on_cpu():
    assert resolve_attention_backend("auto", "cpu", torch.float32) == "cpu"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_attention_backend("torch_native", "cpu", torch.float32) == "torch_native"
    backend = create_attention_backend(
        "cpu", num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, device="cpu"
    )
    assert isinstance(backend, CpuAttnBackend)


@needs_kernel
def test_kernel_refuses_a_shape_it_has_no_case_for():
    """Called directly with an unspecialised head dim, the kernel raises instead of guessing."""
    k_cache = torch.zeros(8, 1, 32)
    with pytest.raises(ValueError, match="no kernel for 2 query heads over 1 KV heads of dim 32"):
        KERNEL(
            torch.zeros(1, 64),
            k_cache,
            k_cache.clone(),
            torch.zeros(2, 8, dtype=torch.int32),
            torch.tensor([1]),
            torch.tensor([3]),
            2,
            0.125,
        )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 1, 64), (18, 1, 64), (8, 2, 128), (3, 3, 128)],
)
def test_extend_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Fresh prompts and extends over cached prefixes, across query blocks (32 new tokens) and
    key tiles (64 keys, 72 on AVX2), ragged, one token long, rows out of order."""
    h = cpu_harness(num_heads, num_kv_heads, dtype, head_dim, max_context_len=512)
    assert h.builder.backend.uses_extend_kernel
    assert h.step([(0, 5), (1, 1), (2, 70), (3, 33)]) < TOL[dtype]
    assert h.step([(2, 1), (0, 40), (3, 100), (1, 3), (4, 64)]) < TOL[dtype]
    assert h.step([(4, 129), (1, 31)]) < TOL[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_equals_torch_native(dtype):
    """Same pool, same batch, prefill-sized: the kernel's output equals torch_native's."""
    gen = torch.Generator().manual_seed(11)
    h = cpu_harness(9, 3, dtype, page_size=16, num_slots=4096, max_context_len=1024)
    h.step([(0, 300), (1, 17)])
    new = [(0, 260), (1, 500), (2, 1), (3, 96)]
    batch = h.builder.build([(rid, [0] * n) for rid, n in new])
    tokens = sum(n for _, n in new)
    q = torch.randn(tokens, 9 * 64, generator=gen).to(dtype)
    k = torch.randn(tokens, 3 * 64, generator=gen).to(dtype)
    v = torch.randn(tokens, 3 * 64, generator=gen).to(dtype)
    layer = h.layers[0]
    got = layer(q, k, v, batch)
    native = TorchNativeAttnBackend()
    batch.attn_backend = native
    native.init_forward_metadata(batch)
    want = layer(q, k, v, batch, save_kv_cache=False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
def test_extend_kernel_refuses_a_shape_it_has_no_case_for():
    k_cache = torch.zeros(8, 1, 32)
    lens = torch.tensor([0]), torch.tensor([2])
    with pytest.raises(ValueError, match="no kernel for 2 query heads over 1 KV heads of dim 32"):
        EXTEND_KERNEL(
            torch.zeros(2, 64),
            k_cache,
            k_cache.clone(),
            torch.zeros(2, 8, dtype=torch.int32),
            torch.tensor([1]),
            *lens,
            2,
            0.125,
        )


def test_attention_range_only_under_a_profiler():
    """A layer's call shows as an "attention" range in a profile (bench_offline --profile
    reads it); outside a profiler the layer runs the same without entering the range."""
    h = Harness(4, 2, torch.float32)
    assert h.step([(0, 5), (1, 3)]) < TOL[torch.float32]  # no profiler
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert h.step([(0, 1), (1, 1)]) < TOL[torch.float32]
    names = [e.name for e in prof.events()]
    assert names.count("attention") == len(h.layers)
