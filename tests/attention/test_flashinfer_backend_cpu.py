"""The flashinfer backend's plan / run logic on CPU, over a pure-torch fake of its wrappers.

The fake (`fake_flashinfer`) implements FlashInfer's documented contract, so these tests pin
down what the backend hands it: which wrapper per batch, the CSR page table at page sizes 1
and 16, the paged "NHD" view of our pool, causal extends on cached prefixes, and the
CUDA-graph capture / replay planning through persistent buffers, and how every wrapper is
built (FA2 kernels, a zeroed workspace). Real kernels: tests/gpu.
"""

from __future__ import annotations

import sys

import pytest
import torch

from attention import RadixAttention, registry
from attention.registry import create_attention_backend, resolve_attention_backend
from srt.model_executor.forward_batch import ForwardMode
from srt.utils import registry as srt_registry
from tests.attention.fake_flashinfer import make_fake_flashinfer
from tests.attention.test_torch_native_backend import Harness

TOL = 3e-2  # bf16
SHAPES = [(4, 4), (8, 2), (8, 1)]  # MHA, GQA (tensor-core decode), MQA


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def make_backend(num_heads: int, num_kv_heads: int, page_size: int, **kw):
    return create_attention_backend(
        "flashinfer",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        dtype=torch.bfloat16,
        device="cpu",
        page_size=page_size,
        workspace_bytes=1024,
        **kw,
    )


def harness(num_heads: int, num_kv_heads: int, page_size: int) -> Harness:
    backend = make_backend(num_heads, num_kv_heads, page_size)
    return Harness(num_heads, num_kv_heads, torch.bfloat16, page_size=page_size, backend=backend)


def record_plans(h: Harness) -> list:
    """Wrap the builder so every batch's planned metadata is appended to the returned list."""
    plans = []
    build = h.builder.build

    def recording_build(*args, **kwargs):
        batch = build(*args, **kwargs)
        plans.append(batch.attn_metadata)
        return batch

    h.builder.build = recording_build
    return plans


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), SHAPES)
def test_extend_then_decode_against_reference(
    fake_flashinfer, page_size: int, num_heads: int, num_kv_heads: int
) -> None:
    h = harness(num_heads, num_kv_heads, page_size)
    plans = record_plans(h)
    assert h.step([(0, 5), (1, 1), (2, 37)]) < TOL  # fresh prompts: ragged
    assert h.step([(0, 4), (1, 19), (3, 6)]) < TOL  # cached prefixes: paged prefill
    for _ in range(3):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL  # decode
    assert h.step([(3, 1), (0, 17), (4, 9)], mode=ForwardMode.MIXED) < TOL
    assert h.step([(2, 1), (0, 1)]) < TOL  # a sub-batch, rows out of order
    kinds = [p.kind.value for p in plans]
    assert kinds == ["ragged_prefill", "paged_prefill"] + ["decode"] * 3 + [
        "paged_prefill",
        "decode",
    ]
    assert plans[-1].wrapper.use_tensor_cores is (num_heads // num_kv_heads >= 4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_capture_then_replay_with_new_batches(fake_flashinfer, page_size: int) -> None:
    """Capture plans a batch into the shared buffers; replay re-plans the same wrapper
    with another batch of that size (the fast plan: no wrapper.plan), and the run step
    reads the new table and work partition."""
    h = harness(8, 2, page_size)
    backend = h.builder.backend
    backend.init_cuda_graph_state(max_bs=4, max_pages_per_req=512 // page_size)
    h.step([(0, 3), (1, 20), (2, 33), (3, 7)])
    plans = record_plans(h)
    decode = [(0, 1), (1, 1), (2, 1), (3, 1)]
    # The first decode step plans through the capture hook, later ones through the replay
    # hook, as the graph runner does.
    backend.init_forward_metadata = backend.init_forward_metadata_capture_cuda_graph
    assert h.step(decode) < TOL
    wrapper = plans[0].wrapper
    assert wrapper.is_cuda_graph_enabled and wrapper._fixed_batch_size == 4
    assert wrapper._paged_kv_indptr_buf.data_ptr() == backend.graphs.indptr.data_ptr()
    assert backend.graphs.paths == {4: "fast"}
    backend.init_forward_metadata = backend.init_forward_metadata_replay_cuda_graph
    for _ in range(3):
        assert h.step(decode) < TOL
    assert all(p.wrapper is wrapper for p in plans)
    assert wrapper.full_plans == 1 and wrapper._cached_module.calls == 1 + 1 + 3


def test_every_wrapper_pins_fa2_on_a_zeroed_workspace(
    fake_flashinfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FA2 for prefill, decode and graph decode (one JIT module family per head_dim, not
    FA3 for prefill beside FA2 for decode), and a workspace that is zero at first use even
    where fresh memory is not: torch.empty is made to return dirty memory while the
    backend is built, as a reused caching-allocator block would be on a GPU."""
    real_empty = torch.empty

    def dirty_empty(*args, **kwargs) -> torch.Tensor:
        return real_empty(*args, **kwargs).fill_(0xAB)

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", dirty_empty)
        backend = make_backend(8, 2, page_size=1)
    assert backend.workspace.dtype == torch.uint8 and not bool(backend.workspace.any())
    h = Harness(8, 2, torch.bfloat16, page_size=1, backend=backend)
    backend.init_cuda_graph_state(max_bs=2, max_pages_per_req=64)
    h.step([(0, 3), (1, 5)])
    backend.init_forward_metadata = backend.init_forward_metadata_capture_cuda_graph
    h.step([(0, 1), (1, 1)])
    (eager,) = backend.wrappers.values()  # one variant
    wrappers = [eager.ragged_prefill, eager.paged_prefill, eager.decode]
    wrappers += [w for by_variant in backend.graphs.wrappers.values() for w in by_variant.values()]
    assert len(wrappers) == 4
    for w in wrappers:
        assert w.init_kwargs["backend"] == "fa2", (type(w).__name__, w.init_kwargs)
        assert w.workspace_was_zero, type(w).__name__
    (graph_wrapper,) = backend.graphs.wrappers[2].values()
    assert graph_wrapper.init_kwargs["use_cuda_graph"]


def test_ragged_path_saves_kv_for_later_decodes(fake_flashinfer) -> None:
    h = harness(4, 2, 16)
    h.step([(0, 18)])
    k_buf = h.builder.kv_pool.get_kv_buffer(1)[0]
    row = h.builder.rows[0]
    slots = h.builder.req_to_token_pool.req_to_token[row, :18].long()
    assert torch.equal(k_buf[slots], h.history[(1, 0)][0])


def test_rejects_float32_and_mismatched_pool(fake_flashinfer) -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        create_attention_backend(
            "flashinfer", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32
        )
    backend = make_backend(4, 2, page_size=16)
    h = Harness(4, 2, torch.bfloat16, page_size=1)  # a page-size-1 pool
    h.builder.backend = backend
    with pytest.raises(ValueError, match="page size"):
        h.builder.build([(0, [0, 0])])


def test_auto_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"flashinfer": True}
    monkeypatch.setattr(registry, "is_package_installed", lambda name: installed[name])
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_attention_backend("auto", "cuda:0", "float16") == "flashinfer"
    assert resolve_attention_backend("auto", "cuda", torch.float32) == "torch_native"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_attention_backend("torch_native", "cuda", torch.bfloat16) == "torch_native"
    installed["flashinfer"] = False
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "torch_native"
    assert resolve_attention_backend("flashinfer", "cpu", torch.bfloat16) == "flashinfer"


def test_a_sliding_window_model_gets_a_backend_that_honours_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every registered backend plans windows now: auto picks flashinfer on CUDA for a
    windowed model too; the guard stays for a backend registered without window support."""
    monkeypatch.setattr(registry, "is_package_installed", lambda name: True)
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16, 4096) == "flashinfer"
    assert resolve_attention_backend("flashinfer", "cuda", torch.bfloat16, 4096) == "flashinfer"
    assert resolve_attention_backend("auto", "cpu", torch.float32, 4096) == "cpu"
    assert resolve_attention_backend("cpu", "cpu", torch.float32, 4096) == "cpu"
    with pytest.raises(ValueError, match="sliding-window"):
        resolve_attention_backend("no_windows_here", "cuda", torch.bfloat16, 4096)


def windowed_harness(heads, kv_heads, page_size, window, cap) -> Harness:
    """Layer 0 full, layer 1 with the window and / or cap; the backend built with both."""
    layers = [
        RadixAttention(heads, 16, 16**-0.5, kv_heads, 0),
        RadixAttention(heads, 16, 16**-0.5, kv_heads, 1, window, cap),
    ]
    backend = make_backend(heads, kv_heads, page_size, layers=layers)
    h = Harness(heads, kv_heads, torch.bfloat16, window=window, logit_cap=cap, page_size=page_size,
                backend=backend)  # fmt: skip
    return h


@pytest.mark.parametrize(("window", "cap"), [(12, None), (None, 2.0), (12, 2.0)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_windowed_and_soft_capped_layers_against_reference(
    fake_flashinfer, page_size: int, num_heads: int, num_kv_heads: int, window, cap
) -> None:
    """Two variants per batch (a full layer and a windowed and / or capped one), each
    layer run by its own variant's wrapper, against the float64 reference with the window
    and cap; prompts, chunks and decodes reach well past the window. Then CUDA-graph
    capture and fast replay plan each variant over the shared page table."""
    h = windowed_harness(num_heads, num_kv_heads, page_size, window, cap)
    backend = h.builder.backend
    assert len(backend.variants) == 2
    plans = record_plans(h)
    assert h.step([(0, 30), (1, 3), (2, 17)]) < TOL  # ragged
    assert h.step([(0, 9), (1, 20), (3, 40)]) < TOL  # paged prefill on cached prefixes
    for _ in range(3):
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    assert all(len(p.wrappers) == 2 for p in plans)
    backend.init_cuda_graph_state(max_bs=4, max_pages_per_req=512 // page_size)
    backend.init_forward_metadata = backend.init_forward_metadata_capture_cuda_graph
    assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    assert backend.graphs.paths == {4: "fast"}
    backend.init_forward_metadata = backend.init_forward_metadata_replay_cuda_graph
    for _ in range(12):  # every request's length moves past the window
        assert h.step([(0, 1), (1, 1), (2, 1), (3, 1)]) < TOL
    graph_wrappers = backend.graphs.wrappers[4].values()
    assert all(w.full_plans == 1 for w in graph_wrappers)  # replays took the fast plan


def test_a_layer_of_an_unplanned_variant_is_refused(fake_flashinfer) -> None:
    """A backend built without the windowed layer must not run it with the full layers'
    plan (it would attend past the window)."""
    backend = make_backend(4, 4, page_size=1)  # built with no layers: one full variant
    h = Harness(4, 4, torch.bfloat16, window=8, page_size=1, backend=backend)
    with pytest.raises(ValueError, match="matches no planned variant"):
        h.step([(0, 5)])


def test_flashinfer_missing_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry checks the requirement (srt.utils.registry), not attention.registry.
    monkeypatch.setattr(srt_registry, "is_package_installed", lambda name: False)
    with pytest.raises(ImportError, match="torch_native"):
        create_attention_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=16)
