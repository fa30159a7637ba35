"""Decode CUDA-graph runner: bucket list, bucket choice, input padding, and the whole
capture / replay flow on CPU (an eager stand-in for the graph, the fake flashinfer backend),
checked against eager forwards of the same batches; and the stream order of the real
capture (`CudaGraphCapture`) through a test double of torch.cuda."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from attention.registry import create_attention_backend
from srt.model_executor.cuda_graph_runner import (
    WARMUP_RUNS,
    CudaGraphCapture,
    CudaGraphRunner,
    EagerCapture,
    GraphCapture,
    capture_batch_sizes,
    graph_forward_batch,
    padded_seq_lens,
    select_bucket,
)
from srt.model_executor.forward_batch import ForwardMode
from srt.model_executor.step_inputs import GRAPH_PADDING, GraphInputs
from srt.server_args import ServerArgs
from srt.utils.device_memory import SharedMemory
from tests.attention.fake_flashinfer import make_fake_flashinfer
from tests.srt.forward_helpers import ForwardBatchBuilder
from tests.srt.test_models import CONFIGS, build_pair


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(160) == [1, 2, 4, 8] + list(range(16, 161, 8))
    assert capture_batch_sizes(256)[-3:] == [240, 248, 256]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(100)[-2:] == [96, 100]  # the cap itself is always captured
    assert capture_batch_sizes(0) == []


def test_select_bucket_pads_to_nearest_captured_size() -> None:
    sizes = capture_batch_sizes(160)
    expected = {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 159: 160, 160: 160}
    for bs, bucket in expected.items():
        assert select_bucket(bs, sizes) == bucket
    assert select_bucket(161, sizes) is None
    for bs in range(1, 161):  # always the smallest captured size that holds the batch
        bucket = select_bucket(bs, sizes)
        assert bucket >= bs and all(s < bs for s in sizes if s < bucket)


def test_inputs_fill_and_pad() -> None:
    """A graph of padded size P reads its five fields at offsets 0, P, .. 4P of one buffer;
    filling a batch of 3 into the graph of 4 pads the fourth row, and touches nothing past
    that graph's fields."""
    pad_len = GRAPH_PADDING["seq_lens"]
    inputs = GraphInputs(8, SharedMemory(torch.device("cpu")))
    inputs.buffer.fill_(99)  # stale data from an earlier, larger batch
    fields = {
        "input_ids": torch.tensor([11, 12, 13]),
        "positions": torch.tensor([4, 9, 2]),
        "out_cache_loc": torch.tensor([40, 41, 42]),
        "req_pool_indices": torch.tensor([5, 1, 7]),
        "seq_lens": torch.tensor([5, 10, 3]),
    }
    inputs.fill(fields, 4)
    views = inputs.views(4)
    assert views["input_ids"].tolist() == [11, 12, 13, 0]
    assert views["positions"].tolist() == [4, 9, 2, 0]
    assert views["out_cache_loc"].tolist() == [40, 41, 42, 0]  # padding writes slot 0
    assert views["req_pool_indices"].tolist() == [5, 1, 7, 0]
    assert views["seq_lens"].tolist() == [5, 10, 3, pad_len]
    assert inputs.buffer[:20].tolist() == [x for v in views.values() for x in v.tolist()]
    assert inputs.buffer[20:].tolist() == [99] * (len(inputs.buffer) - 20)
    assert padded_seq_lens([5, 10, 3], 4) == [5, 10, 3, pad_len]
    view = graph_forward_batch(views, 4, padded_seq_lens([5, 10, 3], 4))
    assert view.batch_size == 4 and view.logits_indices is None and view.graph_bs == 4
    assert view.input_ids.data_ptr() == inputs.buffer.data_ptr()


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "flashinfer", make_fake_flashinfer())


def check_replay_matches_eager(
    config, page_size: int, device: str, capture: GraphCapture | None
) -> None:
    """Prefill 9 requests, then decode sub-batches of several sizes both eagerly and through
    a runner with graphs for 1, 2, 4, 8: the logits must agree (bf16)."""
    _, model = build_pair(config, torch.bfloat16)
    model = model.to(device)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    backend = create_attention_backend(
        "flashinfer",
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
        page_size=page_size,
        workspace_bytes=1024 if device == "cpu" else 128 << 20,
    )
    builder = ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        head_dim,
        dtype=torch.bfloat16,
        page_size=page_size,
        backend=backend,
        max_context_len=128,
        device=device,
    )
    runner = CudaGraphRunner(
        model,
        backend,
        builder.req_to_token_pool,
        builder.kv_pool,
        GraphInputs(8, SharedMemory(torch.device(device))),
        capture=capture,
    )
    assert runner.batch_sizes == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    prompts = {
        rid: torch.randint(0, vocab, (5 + 7 * rid,), generator=gen).tolist() for rid in range(9)
    }
    prefill = builder.build(list(prompts.items()))
    with torch.inference_mode():
        model(prefill.input_ids, prefill.positions, prefill)
    for rids in ([0, 1, 2], [3], [4, 5, 6, 7, 8], [8, 2, 0, 5, 1], [0, 1, 2, 3, 4, 5, 6, 7]):
        tokens = [(rid, [int(torch.randint(0, vocab, (1,), generator=gen))]) for rid in rids]
        batch = builder.build(tokens)
        assert runner.can_run(batch)
        with torch.inference_mode():
            eager = model(batch.input_ids, batch.positions, batch)
            replayed = runner.replay(batch)
        assert replayed.shape == eager.shape == (len(rids), vocab)
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
    big = builder.build([(rid, [1]) for rid in range(9)])
    assert not runner.can_run(big)  # 9 > 8: the model runner runs it eagerly
    assert not runner.can_run(builder.build([(0, [1, 2])], mode=ForwardMode.EXTEND))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("config_name", ["llama", "qwen3_tied"])
def test_replay_matches_eager_decode(fake_flashinfer, page_size: int, config_name: str) -> None:
    check_replay_matches_eager(CONFIGS[config_name], page_size, "cpu", EagerCapture())


class FakeCudaGraphApi:
    """Test double of the torch.cuda pieces `CudaGraphCapture` uses (Stream, current_stream,
    stream, synchronize, CUDAGraph, graph). It logs each call with stream names, keeps the
    current stream as CUDA does, and captures nothing: `graph` just runs its body."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current = "default"
        self.pools = 0

    def Stream(self, device: Any = None) -> FakeStream:  # named as in torch.cuda
        return FakeStream(self, "capture")

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream(self, self.current)

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, s.name
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))
        self.current = previous

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize",))

    def CUDAGraph(self) -> FakeGraph:  # named as in torch.cuda
        self.pools += 1
        return FakeGraph(f"pool{self.pools}")

    @contextmanager
    def graph(self, g: FakeGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        previous, self.current = self.current, stream.name
        self.log.append(("capture_begin", stream.name, pool))
        yield
        self.log.append(("capture_end", stream.name))
        self.current = previous

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("Stream", "current_stream", "stream", "synchronize", "CUDAGraph", "graph"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


class FakeStream:
    def __init__(self, api: FakeCudaGraphApi, name: str) -> None:
        self.api, self.name = api, name

    def wait_stream(self, other: FakeStream) -> None:
        self.api.log.append(("wait_stream", self.name, other.name))


class FakeGraph:
    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id

    def pool(self) -> str:
        return self.pool_id

    def replay(self) -> None:
        pass


def test_capture_warms_up_on_the_capture_stream_then_synchronizes(
    fake_flashinfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per batch size: the capture stream waits for the current one (padding, plan uploads),
    the warm-up forwards run on the capture stream, everything is synchronized, and only
    then is the graph captured on that same stream (all graphs in the first one's pool)."""
    cuda = FakeCudaGraphApi()
    cuda.install(monkeypatch)
    config = CONFIGS["llama"]
    _, model = build_pair(config, torch.bfloat16)
    head_dim = config.hidden_size // config.num_attention_heads
    model.model.register_forward_pre_hook(
        lambda module, args: cuda.log.append(("forward", cuda.current))
    )
    backend = create_attention_backend(
        "flashinfer",
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cpu",
        workspace_bytes=1024,
    )
    builder = ForwardBatchBuilder(
        config.num_hidden_layers,
        config.num_key_value_heads,
        head_dim,
        dtype=torch.bfloat16,
        backend=backend,
        max_context_len=128,
    )
    capture = CudaGraphCapture("cpu")
    inputs = GraphInputs(4, SharedMemory(torch.device("cpu")))
    runner = CudaGraphRunner(
        model, backend, builder.req_to_token_pool, builder.kv_pool, inputs, capture=capture
    )
    assert runner.batch_sizes == [1, 2, 4]
    one_size = [
        ("wait_stream", "capture", "default"),
        ("enter", "capture"),
        *[("forward", "capture")] * WARMUP_RUNS,
        ("exit", "capture"),
        ("synchronize",),
        ("capture_begin", "capture", None),  # the pool: None, then the first graph's
        ("forward", "capture"),
        ("capture_end", "capture"),
    ]
    expected = []
    for i in range(len(runner.batch_sizes)):
        pool = None if i == 0 else "pool1"
        expected += [
            e if e[0] != "capture_begin" else ("capture_begin", "capture", pool) for e in one_size
        ]
    assert cuda.log == expected
    assert cuda.current == "default"


def test_cuda_graph_flags() -> None:
    from srt.server_args_cli import prepare_server_args

    args = prepare_server_args(
        ["--attention-backend", "flashinfer", "--disable-cuda-graph", "--cuda-graph-max-bs", "256"]
    )
    assert args.attention_backend == "flashinfer"
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 256
    defaults = ServerArgs()
    assert not defaults.disable_cuda_graph and defaults.cuda_graph_max_bs == 160
    assert defaults.sampling_backend == "seeded"
