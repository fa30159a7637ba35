"""CUDA-graph decode: capture the decoder at fixed batch sizes, replay padded batches.

Lifecycle (owned by `ModelRunner`, built only on CUDA, with a backend that supports graphs,
and without `--disable-cuda-graph`):

1. `__init__` takes the graphs' static inputs (`step_inputs.GraphInputs`: for padded size P,
   ids, positions, slots, rows and lengths at offsets 0, P, .. 4P of one device buffer) and
   the backend's persistent index buffers, then captures one graph per batch size of
   `capture_batch_sizes(max_bs)` (1, 2, 4, 8, then every 8), largest first, all in one
   memory pool. Each capture plans a dummy decode batch through the backend's capture hook,
   runs the decoder eagerly twice (warm-up, lazy inits, kernel JIT) on the capture stream,
   synchronizes, then captures it on that stream (`GraphCapture.warm_up` / `capture`).
2. `replay(forward_batch)` (a DECODE batch of bs <= max_bs): the model worker stages such a
   batch straight into the inputs of the smallest captured size >= bs, padding included
   (`forward_batch.graph_bs`; padding rows write KV slot 0, the dummy, and read one token of
   request row 0); any other batch is copied in first (`GraphInputs.fill`). Replay re-plans
   attention through the backend's replay hook, replays, and computes logits eagerly from
   the first bs rows of the graph's hidden states.

The graphs cover the decoder only (embedding .. final norm); the LM head and logits run
eagerly on the real rows, so no graph keeps a [bs, vocab] output alive. Replay launches on
the caller's current stream, the one the staging copy and the request-table writes were
queued on, so stream order puts them first. The returned logits are fresh tensors; the
hidden states they come from are overwritten by the next replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.step_inputs import GRAPH_FIELDS, GRAPH_PADDING, GraphInputs

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_bs` (and `max_bs` itself when it is not on it)."""
    if max_bs < 1:
        return []
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def select_bucket(bs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= bs, or None when bs is larger than all of them."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def padded_seq_lens(seq_lens: list[int], padded_bs: int) -> list[int]:
    return list(seq_lens) + [GRAPH_PADDING["seq_lens"]] * (padded_bs - len(seq_lens))


def graph_forward_batch(
    views: dict[str, torch.Tensor], padded_bs: int, seq_lens_cpu: list[int]
) -> ForwardBatch:
    """A DECODE batch over a graph's static inputs (logits for every row)."""
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=padded_bs,
        seq_lens_cpu=seq_lens_cpu,
        graph_bs=padded_bs,
        **views,
    )


class GraphCapture(Protocol):
    def warm_up(self, fn: Callable[[], torch.Tensor], runs: int) -> None:
        """Run `fn` eagerly `runs` times, where `capture` will record it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `fn`; return (replay, its static output tensor)."""


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture on a side stream, every graph in one memory pool."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool: Any = None

    def warm_up(self, fn: Callable[[], torch.Tensor], runs: int) -> None:
        """Warm up on the capture stream itself, then synchronize.

        Why this stream: lazy state that libraries create on first use can be per stream
        (PyTorch's cuBLAS workspace is kept per handle and stream); warmed up on another
        stream, the capture stream's first use, and that setup, would fall inside the
        capture instead of before it.
        Why the wait first: the dummy batch's padding and the attention plan's uploads were
        queued on the current stream. Why the synchronize: capture starts only once the
        warm-up's kernels (and any lazy allocation they made) are done."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(runs):
                fn()
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out


class EagerCapture:
    """Re-runs `fn` at each replay into the same output tensor: the graph runner's logic
    without CUDA (CPU tests)."""

    def warm_up(self, fn: Callable[[], torch.Tensor], runs: int) -> None:
        for _ in range(runs):
            fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        return (lambda: out.copy_(fn())), out


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: Any,
        req_to_token_pool: Any,
        token_to_kv_pool: Any,
        inputs: GraphInputs,
        capture: GraphCapture | None = None,
    ) -> None:
        self.decoder, self.logits_head = split_decoder(model)
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.batch_sizes = capture_batch_sizes(inputs.max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.inputs = inputs
        page_size = token_to_kv_pool.page_size
        max_pages = -(-req_to_token_pool.max_context_len // page_size)
        attn_backend.init_cuda_graph_state(self.max_bs, max_pages)
        self.capture_impl = capture or CudaGraphCapture(inputs.buffer.device)
        self.graphs: dict[int, Callable[[], None]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        tic = time.perf_counter()
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):
                self._capture_one(bs)
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.batch_sizes),
            self.batch_sizes,
            time.perf_counter() - tic,
        )

    def bucket(self, bs: int) -> int | None:
        """The padded size a decode batch of `bs` replays at (None: larger than any)."""
        return select_bucket(bs, self.batch_sizes)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size <= self.max_bs

    def _attach(self, forward_batch: ForwardBatch) -> ForwardBatch:
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        return forward_batch

    def _capture_one(self, bs: int) -> None:
        self.inputs.pad(bs)
        views = self.inputs.views(bs)
        batch = self._attach(graph_forward_batch(views, bs, padded_seq_lens([], bs)))
        self.attn_backend.init_forward_metadata_capture_cuda_graph(batch)

        def run() -> torch.Tensor:
            return self.decoder(batch.input_ids, batch.positions, batch)

        self.capture_impl.warm_up(run, WARMUP_RUNS)
        # Writing the buffers again bumps their version counters, so per-forward caches
        # keyed on them (the rotary cos/sin lookup) miss and get recorded into the graph.
        self.inputs.pad(bs)
        self.graphs[bs], self.hidden[bs] = self.capture_impl.capture(run)
        self.batches[bs] = batch

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32 [bs, vocab]) of a DECODE batch, through the captured graph. A batch
        staged into the graph's inputs (`graph_bs` set) is there already; any other is
        copied in first."""
        bs = forward_batch.batch_size
        padded = forward_batch.graph_bs or select_bucket(bs, self.batch_sizes)
        assert padded is not None, f"batch of {bs} exceeds the captured {self.max_bs}"
        if forward_batch.graph_bs is None:
            fields = {name: getattr(forward_batch, name) for name in GRAPH_FIELDS}
            self.inputs.fill(fields, padded)
        batch = self.batches[padded]
        batch.seq_lens_cpu = padded_seq_lens(forward_batch.seq_lens_cpu, padded)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(batch)
        self.graphs[padded]()
        return self.logits_head(self.hidden[padded][:bs], forward_batch)


def split_decoder(
    model: torch.nn.Module,
) -> tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor, ForwardBatch], torch.Tensor]]:
    """(decoder: ids, positions, batch -> hidden states; head: hidden, batch -> logits) of a
    model built like LlamaForCausalLM (`model`, `lm_head`, `logits_processor`)."""
    for attr in ("model", "lm_head", "logits_processor"):
        if not hasattr(model, attr):
            raise TypeError(f"{type(model).__name__} has no .{attr}: cannot capture its decoder")

    def head(hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return model.logits_processor(hidden, model.lm_head, forward_batch)

    return model.model, head
