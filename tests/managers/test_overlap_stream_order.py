"""The overlap worker's CUDA stream ordering, on CPU, through a test double of torch.cuda.

The scheduler thread writes a batch's `req_to_token` rows and copies its `out_cache_loc`
non-blocking on its own (default) stream; the forward thread runs on a stream of its own.
Every launched batch must therefore go: an event recorded on the scheduler's stream at
`launch()`, then the forward stream waiting on that very event, then the forward. The
double (`FakeCuda`) records those calls in one log, with the calling thread's current
stream, so the test reads the order back. The real race only shows on a GPU
(tests/gpu/test_gpu_engine.py runs the overlap loop against torch_native's outputs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from managers.overlap_worker import OverlapWorker
from managers.schedule_batch import GenerationBatchResult


@dataclass
class FakeStream:
    """Test double of torch.cuda.Stream: a name, and a log entry per `wait_event`."""

    cuda: FakeCuda
    name: str

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", event.id, self.name))


@dataclass
class FakeEvent:
    """Test double of torch.cuda.Event: a log entry per `record`, with the stream."""

    cuda: FakeCuda
    id: int

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.cuda.log.append(("record", self.id, stream.name))


@dataclass
class FakeCuda:
    """Test double of the torch.cuda pieces the overlap worker uses (Stream, Event,
    current_stream, set_stream), with a per-thread current stream as in CUDA."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    local: threading.local = field(default_factory=threading.local)
    events: int = 0
    streams: int = 0

    def Stream(self, device: Any = None) -> FakeStream:  # named as in torch.cuda
        self.streams += 1
        return FakeStream(self, f"side{self.streams}")

    def Event(self) -> FakeEvent:  # named as in torch.cuda
        self.events += 1
        return FakeEvent(self, self.events)

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self.local, "stream", None) or FakeStream(self, "default")

    def set_stream(self, stream: FakeStream) -> None:
        self.local.stream = stream

    def current_device(self) -> int:
        return 1  # the scheduler thread of a tensor-parallel rank on GPU 1

    def set_device(self, device: torch.device) -> None:
        self.log.append(("set_device", str(device)))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        names = ("Stream", "Event", "current_stream", "set_stream", "current_device", "set_device")
        for name in names:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


@dataclass
class FakeBatch:
    """The two fields of a ModelWorkerBatch the overlap worker itself reads."""

    input_ids: torch.Tensor
    seq_lens_cpu: list[int]


class LoggingWorker:
    """A model worker on "cuda" that logs each forward with its thread's current stream and
    returns token 100 + the batch's first resolved input id per request."""

    def __init__(self, cuda: FakeCuda, device: str = "cuda") -> None:
        self.cuda = cuda
        self.device = device
        self.model_config = None

    def forward_batch_generation(self, mwb: FakeBatch) -> GenerationBatchResult:
        first = int(mwb.input_ids[0])
        self.cuda.log.append(("forward", first, self.cuda.current_stream().name))
        return GenerationBatchResult(next_token_ids=[100 + first] * len(mwb.seq_lens_cpu))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def make_worker() -> Iterator[Any]:
    """Builds overlap workers; stops and joins their threads before the double is removed."""
    made: list[OverlapWorker] = []

    def make(worker: LoggingWorker) -> OverlapWorker:
        made.append(OverlapWorker(worker, max_batch_size=4))
        return made[-1]

    yield make
    for w in made:
        w.stop()
        w.thread.join(timeout=10)
        assert not w.thread.is_alive()


def test_forward_stream_waits_for_each_launch_event(cuda: FakeCuda, make_worker) -> None:
    ow = make_worker(LoggingWorker(cuda))
    # Several batches queued at once (the thread may still be on an earlier forward), the
    # later ones carrying the earlier ones' future token ids.
    first = ow.launch(FakeBatch(torch.tensor([1, 2]), [3, 3]))
    ow.launch(FakeBatch(torch.tensor([2, 7, 7]), [4, 4, 4]))
    ow.launch(FakeBatch(torch.tensor([first[0]]), [5]))  # resolves to batch 1's token, 101
    results = [ow.wait_result().result for _ in range(3)]
    assert [r.next_token_ids for r in results] == [[101] * 2, [102] * 3, [201]]

    log = list(cuda.log)
    # The forward thread starts on the scheduler thread's device, not on cuda:0.
    assert log.count(("set_device", "cuda:1")) == 1
    assert log.index(("set_device", "cuda:1")) < log.index(("forward", 1, "side1"))
    records = [e for e in log if e[0] == "record"]
    waits = [e for e in log if e[0] == "wait"]
    forwards = [e for e in log if e[0] == "forward"]
    assert len(records) == len(waits) == len(forwards) == 3
    # Recorded on the scheduler thread's (default) stream; waited and run on the forward
    # thread's own stream.
    assert {r[2] for r in records} == {"default"}
    assert {w[2] for w in waits} == {f[2] for f in forwards} == {"side1"}
    for k, forward in enumerate(forwards):
        event_id = records[k][1]
        wait = ("wait", event_id, "side1")
        assert log.index(records[k]) < log.index(wait) < log.index(forward), log
        # The forward thread's last call before this forward is the wait on this batch's
        # own event (not an older one).
        thread_calls = [e for e in log[: log.index(forward)] if e[0] != "record"]
        assert thread_calls[-1] == wait, log


def test_cpu_worker_touches_no_cuda_api(monkeypatch: pytest.MonkeyPatch, make_worker) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda used on a CPU worker")

    for name in ("Stream", "Event", "current_stream", "set_stream", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    cuda = FakeCuda()
    ow = make_worker(LoggingWorker(cuda, device="cpu"))
    ow.launch(FakeBatch(torch.tensor([4]), [1]))
    assert ow.wait_result().result.next_token_ids == [104]
    assert [e[0] for e in cuda.log] == ["forward"]
