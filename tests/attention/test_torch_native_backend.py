"""torch_native attention vs a dense float64 reference over the same KV history."""

from __future__ import annotations

import pytest
import torch

import attention.torch_native_decode as decode_mod
from attention import RadixAttention, create_attention_backend
from attention.torch_native_backend import TorchNativeAttnBackend
from attention.torch_native_decode import DecodePlan
from srt.model_executor.forward_batch import ForwardMode
from tests.srt.forward_helpers import ForwardBatchBuilder


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    window: int | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """q [ext, H, D] at positions prefix_len.., k/v [S, Hkv, D] -> [ext, H, D] in float64;
    with `window`, position p sees keys p - window + 1..p (HF's sliding window); with
    `logit_cap`, scores are cap * tanh(score / cap) (Gemma 2)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if logit_cap is not None:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    query_pos = torch.arange(q.shape[0])[:, None] + prefix_len
    key_pos = torch.arange(k.shape[0])[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Harness:
    """Runs RadixAttention layers over builder batches and checks each against the reference."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        dtype: torch.dtype,
        head_dim: int = 16,
        window: int | None = None,
        logit_cap: float | None = None,
        **builder_kwargs,  # page_size, device, backend, ... of ForwardBatchBuilder
    ):
        """`window`: layer 1 attends through a sliding window of that many positions (layer
        0 sees everything), as a Qwen2 model with `max_window_layers` mixes them; the backend
        must be built with it. `logit_cap`: layer 1 soft-caps its scores (Gemma 2)."""
        self.h, self.hkv, self.d, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.layers = [
            RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, 0),
            RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, 1, window, logit_cap),
        ]
        self.builder = ForwardBatchBuilder(2, num_kv_heads, head_dim, dtype=dtype, **builder_kwargs)
        self.history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(1234)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.builder.device, self.dtype)

    def fork(self, src: int, dst: int) -> None:
        """Request `dst` starts with `src`'s cached tokens, on the same KV slots."""
        shared = self.builder.share_prefix(src, dst)
        for layer in self.layers:
            k_all, v_all = self.history[(layer.layer_id, src)]
            self.history[(layer.layer_id, dst)] = (k_all[:shared], v_all[:shared])

    def step(self, new_lens: list[tuple[int, int]], mode: ForwardMode | None = None) -> float:
        """Run one batch through both layers; return the max abs error vs the reference."""
        prefix_lens = {rid: self.builder.seq_lens.get(rid, 0) for rid, _ in new_lens}
        batch = self.builder.build([(rid, [0] * n) for rid, n in new_lens], mode=mode)
        num_tokens = sum(n for _, n in new_lens)
        worst = 0.0
        for layer in self.layers:
            q = self.randn(num_tokens, self.h * self.d)
            k = self.randn(num_tokens, self.hkv * self.d)
            v = self.randn(num_tokens, self.hkv * self.d)
            out = layer(q, k, v, batch)
            assert out.shape == q.shape and out.dtype == self.dtype
            start = 0
            for rid, n in new_lens:
                key = (layer.layer_id, rid)
                k_new = k[start : start + n].view(n, self.hkv, self.d)
                v_new = v[start : start + n].view(n, self.hkv, self.d)
                k_old, v_old = self.history.get(key, (k_new[:0], v_new[:0]))
                k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
                self.history[key] = (k_all, v_all)
                q_req = q[start : start + n].view(n, self.h, self.d)
                ref = reference_attention(
                    q_req.cpu(),
                    k_all.cpu(),
                    v_all.cpu(),
                    prefix_lens[rid],
                    layer.scaling,
                    layer.sliding_window,
                    layer.logit_cap,
                )
                got = out[start : start + n].view(n, self.h, self.d).double().cpu()
                worst = max(worst, (got - ref).abs().max().item())
                start += n
        return worst


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
SHAPES = [(4, 4), (9, 3), (8, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), SHAPES)
def test_extend_ragged_with_cached_prefix(dtype: torch.dtype, num_heads: int, num_kv_heads: int):
    h = Harness(num_heads, num_kv_heads, dtype)
    assert h.step([(0, 5), (1, 1), (2, 9)]) < TOL[dtype]  # fresh prompts, one of length 1
    assert h.step([(0, 4), (1, 7), (2, 3), (3, 6)]) < TOL[dtype]  # on top of cached prefixes
    assert h.step([(2, 2), (0, 11)]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), SHAPES)
def test_decode_batch(dtype: torch.dtype, num_heads: int, num_kv_heads: int):
    h = Harness(num_heads, num_kv_heads, dtype)
    h.step([(0, 3), (1, 17), (2, 1), (3, 8)])
    for _ in range(4):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL[dtype]
    assert h.step([(3, 1), (1, 1)]) < TOL[dtype]  # a sub-batch, rows out of order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_extend_and_decode(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """A windowed layer beside a full one: prompts shorter and longer than the window, an
    extend over a cached prefix longer than it (the chunked or cached case), query blocks
    that straddle its edge, decodes in several length buckets."""
    monkeypatch.setattr(decode_mod, "DECODE_BUCKET_MIN_REQS", 2)
    window = 7
    h = Harness(9, 3, dtype, window=window, backend=TorchNativeAttnBackend(sliding_window=window))
    assert h.step([(0, 5), (1, 30), (2, 1), (3, 200)]) < TOL[dtype]
    assert h.step([(0, 9), (1, 2), (3, 140)]) < TOL[dtype]
    for _ in range(3):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL[dtype]
    h.fork(3, 4)  # a cached prefix far longer than the window, then more of the prompt
    assert h.step([(4, 12)]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores(dtype: torch.dtype):
    """Gemma 2's soft-capping (cap 0.5, where the scores' spread is about 1: it bites) on a
    windowed layer, extend over a cached prefix and decode."""
    window = 9
    backend = TorchNativeAttnBackend(sliding_window=window)
    h = Harness(8, 2, dtype, window=window, logit_cap=0.5, backend=backend)
    h.gen.manual_seed(7)
    assert h.step([(0, 20), (1, 3)]) < TOL[dtype]
    assert h.step([(0, 6), (1, 1)]) < TOL[dtype]
    assert h.step([(0, 1), (1, 1)]) < TOL[dtype]


def test_a_windowed_layer_needs_a_backend_built_with_its_window():
    h = Harness(4, 4, torch.float32, window=7)
    with pytest.raises(AssertionError, match="window"):
        h.step([(0, 9)])


def test_decode_plan_single_bucket():
    h = Harness(4, 2, torch.float32)
    h.step([(0, 2), (1, 5)])
    plan = h.builder.build([(0, [0]), (1, [0])]).attn_metadata
    assert isinstance(plan, DecodePlan) and plan.staged
    (bucket,) = plan.buckets
    assert bucket.rows is None  # one bucket: the batch in its own order
    assert bucket.cap == 6 + decode_mod.STAGING_HEADROOM
    assert bucket.bias.shape == (2, 1, 1, bucket.cap)
    row0 = bucket.bias[0, 0, 0]
    assert (row0[:3] == 0).all() and torch.isinf(row0[3:]).all()  # request 0 has 3 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_in_length_buckets(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """Enough requests to be split into length buckets; each row must still be exact."""
    monkeypatch.setattr(decode_mod, "DECODE_BUCKET_MIN_REQS", 8)
    monkeypatch.setattr(decode_mod, "DECODE_MAX_BUCKETS", 2)
    h = Harness(6, 2, dtype)
    lengths = [1 + (7 * i) % 23 for i in range(16)]
    h.step(list(enumerate(lengths)))
    for _ in range(3):
        assert h.step([(i, 1) for i in range(16)]) < TOL[dtype]
    buckets = h.builder.build([(i, [0]) for i in range(16)]).attn_metadata.buckets
    assert len(buckets) == 2
    assert sorted(r for b in buckets for r in b.rows.tolist()) == list(range(16))
    short, long = (max(lengths[r] for r in b.rows.tolist()) for b in buckets)
    assert short <= min(lengths[r] for r in buckets[1].rows.tolist()) <= long


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_kv_reused_then_replanned(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """Decode steps of one batch append to the staged K/V; any change re-gathers."""
    monkeypatch.setattr(decode_mod, "STAGING_HEADROOM", 2)
    h = Harness(4, 2, dtype)
    h.step([(0, 5), (1, 9), (2, 3)])
    plans = []
    for _ in range(5):  # outgrows the headroom of 2 once, then re-gathers with new capacity
        assert h.step([(0, 1), (1, 1), (2, 1)]) < TOL[dtype]
        plans.append(h.builder.backend._decode_plan)
    # Longest request: 10 tokens at the first decode, so capacity 12 holds two more steps.
    assert plans[2].buckets is plans[0].buckets  # continued: same staged buffers
    assert plans[3].buckets is not plans[2].buckets  # capacity reached: fresh gather
    assert plans[4].buckets is plans[3].buckets
    assert h.step([(0, 1), (2, 1)]) < TOL[dtype]  # a request left: fresh plan
    assert h.step([(0, 4), (2, 1), (3, 6)], mode=ForwardMode.MIXED) < TOL[dtype]
    assert h.builder.backend._decode_plan is None  # an extend drops the staged K/V
    assert h.step([(0, 1), (2, 1), (3, 1)]) < TOL[dtype]


def test_staging_off_above_byte_budget(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(decode_mod, "STAGING_MAX_BYTES", 1)
    h = Harness(4, 2, torch.float32)
    h.step([(0, 5), (1, 9)])
    for _ in range(3):
        assert h.step([(0, 1), (1, 1)]) < TOL[torch.float32]
        assert not h.builder.backend._decode_plan.staged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_extend_and_decode(dtype: torch.dtype):
    h = Harness(6, 2, dtype)
    h.step([(0, 10), (1, 3)])
    mixed = [(0, 1), (1, 6), (2, 4)]  # a decode, an extend on a prefix, a new prompt
    assert h.step(mixed, mode=ForwardMode.MIXED) < TOL[dtype]
    assert h.step([(0, 1), (1, 1), (2, 1)]) < TOL[dtype]


def test_kv_written_to_out_cache_loc_per_layer():
    h = Harness(4, 2, torch.float32)
    batch = h.builder.build([(0, [0, 0, 0])])
    k = torch.randn(3, 2 * 16)
    v = torch.randn(3, 2 * 16)
    h.layers[1](torch.randn(3, 4 * 16), k, v, batch)
    k_buf, v_buf = h.builder.kv_pool.get_kv_buffer(1)
    torch.testing.assert_close(k_buf[batch.out_cache_loc], k.view(3, 2, 16))
    torch.testing.assert_close(v_buf[batch.out_cache_loc], v.view(3, 2, 16))
    assert h.builder.kv_pool.get_kv_buffer(0)[0].abs().sum() == 0  # layer 0 untouched


def test_registry():
    assert isinstance(create_attention_backend("torch_native"), TorchNativeAttnBackend)
    with pytest.raises(ValueError, match="torch_native"):
        create_attention_backend("no_such_backend")


def test_registry_names_missing_package(monkeypatch: pytest.MonkeyPatch):
    """A backend whose pip package is absent fails with an install hint, before any import."""
    from attention import registry
    from srt.utils.registry import Registry

    backends = Registry("attention backend")
    backends.register("needs_pkg", "attention.nowhere:Nothing", requires="no_such_pkg_xyz")
    monkeypatch.setattr(registry, "ATTENTION_BACKENDS", backends)
    with pytest.raises(ImportError, match="no_such_pkg_xyz"):
        create_attention_backend("needs_pkg")
