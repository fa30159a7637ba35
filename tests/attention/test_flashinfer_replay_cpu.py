"""The flashinfer backend's CUDA-graph replay plan on CPU, over the FlashInfer double.

The fast replay (in-place page table, FlashInfer's module plan called directly) must leave
exactly what the full `wrapper.plan` leaves: page table, work partition, plan info, and so
the same attention, at page sizes 1 and 16, on both decode kernels (CUDA-core and tensor
core), for padded batches. Also: no device -> host reads on its path, the pinned-buffer
guard waits only on an event that has not completed, and the full plan takes over where
FlashInfer's internals are not the ones the fast plan knows.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch

import tests.attention.fake_flashinfer_plan as fake_plan
from attention import RadixAttention, flashinfer_utils
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from tests.attention.fake_flashinfer import make_fake_flashinfer
from tests.attention.test_flashinfer_backend_cpu import make_backend
from tests.gpu.test_flashinfer_graph_replay import eager_graph, run_graph_steps
from tests.srt.forward_helpers import ForwardBatchBuilder

HEAD_DIM = 16
SIZES = [1, 2, 4, 8]  # captured batch sizes
# Batches of request ids: padded to 1, 4, 8, 8, 4, 2, 8, with lengths that keep growing.
STEPS = [[0], [0, 1, 2], [3, 4, 5, 6, 7], [2, 0, 5, 1, 7, 6, 3, 4], [6, 1, 4], [7, 5], [*range(8)]]


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch):
    module = make_fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


class Graphs:
    """A builder whose pools the captured graphs read, and backends that capture sizes 1,
    2, 4, 8 through the capture hook, then re-plan padded decode batches by replay."""

    def __init__(self, heads: int, kv_heads: int, page_size: int) -> None:
        self.shape = (heads, kv_heads)
        self.builder = ForwardBatchBuilder(
            2, kv_heads, HEAD_DIM, dtype=torch.bfloat16, page_size=page_size, max_reqs=9
        )
        gen = torch.Generator().manual_seed(7)
        for layer_id in range(2):
            for buf in self.builder.kv_pool.get_kv_buffer(layer_id):
                buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
        self.builder.backend = make_backend(heads, kv_heads, page_size)
        self.builder.build([(rid, [0] * (3 + 11 * rid)) for rid in range(8)])
        self.layers = [
            RadixAttention(heads, HEAD_DIM, HEAD_DIM**-0.5, kv_heads, i) for i in range(2)
        ]
        self.page_size = page_size

    def capture(self, **kw) -> object:
        backend = make_backend(*self.shape, self.page_size, **kw)
        backend.init_cuda_graph_state(max_bs=8, max_pages_per_req=512 // self.page_size)
        for bs in reversed(SIZES):
            backend.init_forward_metadata_capture_cuda_graph(self.dummy(bs))
        return backend

    def dummy(self, bs: int) -> ForwardBatch:
        zeros = torch.zeros(bs, dtype=torch.int64)
        return self._batch(bs, zeros, zeros, zeros, zeros + 1, [1] * bs)

    def decode(self, rids: list[int]) -> ForwardBatch:
        return self.builder.build([(rid, [0]) for rid in rids])

    def padded(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """`batch` padded to bs as the graph runner pads (row 0, one token, slot 0)."""
        pad = bs - batch.batch_size
        zeros = torch.zeros(pad, dtype=torch.int64)
        return self._batch(
            bs,
            torch.cat([batch.input_ids, zeros]),
            torch.cat([batch.out_cache_loc, zeros]),
            torch.cat([batch.req_pool_indices, zeros]),
            torch.cat([batch.seq_lens, zeros + 1]),
            list(batch.seq_lens_cpu) + [1] * pad,
        )

    def _batch(self, bs, ids, loc, rows, lens, lens_cpu) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=ids,
            positions=lens - 1,
            out_cache_loc=loc,
            req_pool_indices=rows,
            seq_lens=lens,
            seq_lens_cpu=lens_cpu,
            req_to_token_pool=self.builder.req_to_token_pool,
            token_to_kv_pool=self.builder.kv_pool,
        )

    def queries(self, rows: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(2, rows, self.shape[0] * HEAD_DIM, generator=gen).bfloat16()

    def attend(self, backend, batch: ForwardBatch, queries: torch.Tensor) -> torch.Tensor:
        """Both layers' decode attention of `batch` as planned (no KV written)."""
        outs = []
        for layer, q in zip(self.layers, queries):
            kv = torch.zeros(batch.batch_size, self.shape[1] * HEAD_DIM, dtype=torch.bfloat16)
            outs.append(backend.forward_decode(q, kv, kv, layer, batch, save_kv_cache=False))
        return torch.stack(outs)


def bucket(n: int) -> int:
    return next(s for s in SIZES if s >= n)


def graph_state(backend, bs: int, total: int) -> list[torch.Tensor]:
    graphs = backend.graphs
    (wrapper,) = graphs.wrappers[bs].values()  # one variant
    return [
        graphs.indptr[: bs + 1].clone(),
        graphs.indices[:total].clone(),
        graphs.last_page_len[:bs].clone(),
        wrapper._int_workspace_buffer.clone(),
        wrapper._pin_memory_int_workspace_buffer.clone(),
        torch.tensor(wrapper._plan_info),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 2)])  # CUDA-core, tensor-core
def test_fast_replay_equals_full_plan(fake_flashinfer, page_size, heads, kv_heads) -> None:
    g = Graphs(heads, kv_heads, page_size)
    fast, full = g.capture(), g.capture(fast_replay=False)
    assert set(fast.graphs.paths.values()) == {"fast"}
    assert set(full.graphs.paths.values()) == {"full wrapper.plan: fast_replay=False"}
    for rids in STEPS:
        batch = g.decode(rids)
        bs = bucket(len(rids))
        ours, theirs = g.padded(batch, bs), g.padded(batch, bs)
        fast.init_forward_metadata_replay_cuda_graph(ours)
        full.init_forward_metadata_replay_cuda_graph(theirs)
        total = sum(-(-n // page_size) for n in ours.seq_lens_cpu)
        for a, b in zip(graph_state(fast, bs, total), graph_state(full, bs, total)):
            assert torch.equal(a, b)
        queries = g.queries(bs, seed=len(rids))
        got = g.attend(fast, ours, queries)
        assert torch.equal(got, g.attend(full, theirs, queries))
        eager = g.attend(full, batch, queries[:, : len(rids)])  # planned by the builder
        assert torch.equal(got[:, : len(rids)], eager)
    wrappers = [w for by_variant in fast.graphs.wrappers.values() for w in by_variant.values()]
    assert all(w.full_plans == 1 for w in wrappers)  # capture only: replays never called it


@contextmanager
def no_device_reads() -> Iterator[None]:
    """Make every tensor -> Python read (what syncs with a GPU) raise."""

    def trap(name: str):
        def raise_(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} on the replay path")

        return raise_

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, trap(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fast_replay_reads_nothing_back(fake_flashinfer, page_size: int) -> None:
    g = Graphs(8, 2, page_size)
    backend = g.capture()
    batches = [g.padded(g.decode(rids), bucket(len(rids))) for rids in STEPS]
    with no_device_reads():
        for batch in batches:
            backend.init_forward_metadata_replay_cuda_graph(batch)


class FakeEvent:
    """A torch.cuda.Event double: `done` says whether the GPU has reached it."""

    done = True
    log: ClassVar[list[str]] = []

    def record(self) -> None:
        self.log.append("record")

    def query(self) -> bool:
        self.log.append("query")
        return self.done

    def synchronize(self) -> None:
        self.log.append("synchronize")


@pytest.mark.parametrize("done", [True, False])
def test_pinned_guard_waits_only_on_pending_event(
    fake_flashinfer, monkeypatch: pytest.MonkeyPatch, done: bool
) -> None:
    log: ClassVar[list[str]] = []
    monkeypatch.setattr(FakeEvent, "log", log)
    monkeypatch.setattr(FakeEvent, "done", done)
    monkeypatch.setattr(flashinfer_utils, "plan_event_factory", lambda device: FakeEvent)
    upload = fake_plan._upload_partition

    def logged_upload(*args) -> None:
        log.append("write")
        upload(*args)

    monkeypatch.setattr(fake_plan, "_upload_partition", logged_upload)
    g = Graphs(4, 2, page_size=16)
    batches = [g.padded(g.decode([0, 1, 2]), 4) for _ in range(3)]
    backend = make_backend(4, 2, 16)
    backend.init_cuda_graph_state(max_bs=4, max_pages_per_req=32)
    log.clear()
    backend.init_forward_metadata_capture_cuda_graph(g.dummy(4))
    for batch in batches:
        backend.init_forward_metadata_replay_cuda_graph(batch)
    # capture: full plan, then the fast plan's self-check; then three replays.
    plan = ["write", "record"]
    check = ["query"] + ([] if done else ["synchronize"])
    assert log == plan + 4 * (check + plan)
    assert backend.guard.waits == (0 if done else 4)
    # Eager plans are guarded too, one event per wrapper.
    log.clear()
    g.builder.backend = backend
    g.decode([0, 1])
    g.decode([0, 1])
    assert log == plan + check + plan


def test_fallback_when_flashinfer_is_another_release(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer(version="0.6.1"))
    check_full_plan_replays(caplog, "full wrapper.plan: flashinfer 0.6.1 is not 0.7.2")


def test_fallback_when_an_internal_is_missing(fake_flashinfer, monkeypatch, caplog) -> None:
    class Renamed(fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper):
        def plan(self, *args, **kwargs) -> None:
            super().plan(*args, **kwargs)
            self._module = self.__dict__.pop("_cached_module")

    monkeypatch.setattr(fake_flashinfer, "BatchDecodeWithPagedKVCacheWrapper", Renamed)
    check_full_plan_replays(caplog, "full wrapper.plan: the decode wrapper lacks _cached_module")


def test_fallback_when_the_self_check_differs(fake_flashinfer, monkeypatch, caplog) -> None:
    """A module plan whose second call answers differently (as one with other arguments
    would): the capture-time check catches it and plans in full again."""
    real = fake_plan.FakeDecodePlanModule.plan

    def drifting(self, *args) -> list[int]:
        return real(self, *args) + [self.calls]

    monkeypatch.setattr(fake_plan.FakeDecodePlanModule, "plan", drifting)
    reason = "full wrapper.plan: the fast plan's plan info differs from the full plan's"
    check_full_plan_replays(caplog, reason, full_plans_at_capture=2)


def check_full_plan_replays(caplog, reason: str, full_plans_at_capture: int = 1) -> None:
    g = Graphs(4, 2, page_size=1)
    with caplog.at_level(logging.INFO, logger="attention.flashinfer_replay"):
        backend = g.capture()
    assert set(backend.graphs.paths.values()) == {reason}
    logged = [r.getMessage() for r in caplog.records if r.name == "attention.flashinfer_replay"]
    assert len(logged) == 1 and logged[0].endswith(reason)  # once for all four sizes
    (wrapper,) = backend.graphs.wrappers[4].values()
    assert wrapper.full_plans == full_plans_at_capture
    for step in range(3):
        batch = g.decode([0, 1, 2])
        padded = g.padded(batch, 4)
        backend.init_forward_metadata_replay_cuda_graph(padded)
        queries = g.queries(4, seed=step)
        got = g.attend(backend, padded, queries)
        assert torch.equal(got[:, :3], g.attend(backend, batch, queries[:, :3]))
    assert wrapper.full_plans == full_plans_at_capture + 3


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 2)])
def test_gpu_replay_driver_on_the_double(fake_flashinfer, page_size, heads, kv_heads) -> None:
    """tests/gpu/test_flashinfer_graph_replay's driver, here with eager "graphs"."""
    worst, backend = run_graph_steps("cpu", heads, kv_heads, HEAD_DIM, page_size, eager_graph)
    assert set(backend.graphs.paths.values()) == {"fast"}
    assert worst < 3e-2


def test_replay_rejects_unpadded_host_lengths(fake_flashinfer) -> None:
    g = Graphs(4, 2, page_size=1)
    backend = g.capture()
    batch = g.padded(g.decode([0, 1, 2]), 4)
    batch.seq_lens_cpu = batch.seq_lens_cpu[:3]
    with pytest.raises(ValueError, match="3 entries for a graph of 4"):
        backend.init_forward_metadata_replay_cuda_graph(batch)
