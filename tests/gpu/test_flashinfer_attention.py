"""FlashInfer vs torch_native attention on a GPU, bf16, ragged batches on cached prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from attention import RadixAttention, create_attention_backend
from attention.torch_native_backend import TorchNativeAttnBackend
from srt.model_executor.forward_batch import ForwardMode
from tests.attention.test_torch_native_backend import Harness
from tests.srt.forward_helpers import ForwardBatchBuilder

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 outputs of O(1) magnitude
# (heads, kv heads, head dim): SmolLM2-135M, Qwen3-0.6B, a group of 4 (tensor-core decode)
SHAPES = [(9, 3, 64), (16, 8, 128), (32, 8, 128)]


def flashinfer_backend(heads: int, kv_heads: int, head_dim: int, page_size: int, layers=()):
    return create_attention_backend(
        "flashinfer",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        page_size=page_size,
        layers=layers,
    )


class Pair:
    """The same batches through both backends: twin builders with the same slot layout."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
        def builder(backend):
            return ForwardBatchBuilder(
                2,
                kv_heads,
                head_dim,
                dtype=torch.bfloat16,
                num_slots=1 << 16,
                max_reqs=32,
                max_context_len=2048,
                backend=backend,
                page_size=page_size,
                device="cuda",
            )

        self.shape = (heads, kv_heads, head_dim)
        self.ours = builder(flashinfer_backend(heads, kv_heads, head_dim, page_size))
        self.ref = builder(TorchNativeAttnBackend())
        self.layers = [
            RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, i) for i in range(2)
        ]

    def step(self, new_lens: list[tuple[int, int]], mode: ForwardMode | None = None) -> float:
        tokens = [(rid, [0] * n) for rid, n in new_lens]
        ours, ref = self.ours.build(tokens, mode=mode), self.ref.build(tokens, mode=mode)
        assert torch.equal(ours.out_cache_loc, ref.out_cache_loc)
        heads, kv_heads, head_dim = self.shape
        total = sum(n for _, n in new_lens)
        worst = 0.0
        for layer in self.layers:
            q = torch.randn(total, heads * head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(total, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(total, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16)
            a = layer(q, k, v, ours)
            b = layer(q, k, v, ref)
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        return worst


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_random_ragged_batches_agree(page_size: int, heads: int, kv_heads: int, head_dim: int):
    rng = random.Random(page_size * 1000 + heads)
    pair = Pair(heads, kv_heads, head_dim, page_size)
    live: list[int] = []
    for step in range(12):
        if step % 3 == 0:  # extend: new prompts and chunks on cached prefixes, ragged
            rids = rng.sample(range(24), 6)
            lens = [(rid, rng.choice([1, 7, 16, 17, rng.randint(2, 300)])) for rid in rids]
            mode = ForwardMode.MIXED if any(rid in live for rid in rids) else None
            assert pair.step(lens, mode) < TOL
            live = sorted(set(live) | set(rids))
        else:  # decode every live request
            assert pair.step([(rid, 1) for rid in live]) < TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_against_float64_reference(page_size: int) -> None:
    heads, kv_heads, head_dim = 16, 8, 128
    h = Harness(
        heads,
        kv_heads,
        torch.bfloat16,
        head_dim=head_dim,
        page_size=page_size,
        device="cuda",
        backend=flashinfer_backend(heads, kv_heads, head_dim, page_size),
    )
    assert h.step([(0, 100), (1, 1), (2, 33)]) < TOL
    assert h.step([(0, 20), (1, 40), (3, 5)], mode=ForwardMode.MIXED) < TOL
    for _ in range(5):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL


@pytest.mark.parametrize(("window", "cap"), [(40, None), (None, 5.0), (40, 5.0)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 2)])  # decode kernel, tensor cores
def test_windowed_and_soft_capped_layers_against_float64(page_size, heads, kv_heads, window, cap):
    """A full layer beside a windowed and / or soft-capped one (Gemma 2's local and global
    layers), each run by its own planned variant, against the float64 reference; lengths
    reach far past the window; then the CUDA-graph capture and replay plans of both."""
    head_dim = 64
    layers = [
        RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0),
        RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 1, window, cap),
    ]
    backend = flashinfer_backend(heads, kv_heads, head_dim, page_size, layers)
    h = Harness(heads, kv_heads, torch.bfloat16, head_dim=head_dim, window=window,
                logit_cap=cap, page_size=page_size, device="cuda", backend=backend)  # fmt: skip
    assert h.step([(0, 100), (1, 3), (2, 57)]) < TOL
    assert h.step([(0, 20), (1, 70), (3, 45)], mode=ForwardMode.MIXED) < TOL
    for _ in range(3):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    backend.init_cuda_graph_state(max_bs=4, max_pages_per_req=512 // page_size)
    backend.init_forward_metadata = backend.init_forward_metadata_capture_cuda_graph
    assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    backend.init_forward_metadata = backend.init_forward_metadata_replay_cuda_graph
    for _ in range(4):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    assert backend.graphs.paths == {4: "fast"}
