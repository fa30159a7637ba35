"""Captured FlashInfer decode attention, replayed step after step with changing batches.

Graphs of two attention layers are captured at batch sizes 1, 2, 4, 8; then decode steps of
changing membership and growing lengths replay them (padded), with no host sync between
steps and the device held back by a sleep, so the host plans step N+1 while step N still
waits to run: the fast replay plan's in-place page table and its pinned-buffer guard meet
a device that lags. Every step must equal eager torch_native attention on a twin pool.
`run_graph_steps` takes the device and the capture, so the CPU suite runs this driver
over the FlashInfer double (tests/attention/test_flashinfer_replay_cpu.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attention import RadixAttention, create_attention_backend
from attention.torch_native_backend import TorchNativeAttnBackend
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from tests.srt.forward_helpers import ForwardBatchBuilder

TOL = 2e-2  # bf16
SIZES = (1, 2, 4, 8)
# Request ids per decode step: every captured size, padding, rows out of order.
STEPS = [[0], [0, 1, 2], [3, 4, 5, 6, 7], [2, 0, 5, 1, 7, 6, 3, 4], [6, 1, 4], [7, 5]]
STEPS += [list(range(8)), [4], [1, 3, 5], list(range(7, -1, -1))] * 2
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time before each step: the host runs ahead
Graph = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph(pool: object) -> Graph:
    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (FlashInfer JIT, lazy inits) off-capture
            for _ in range(2):
                fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


def eager_graph(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    out = fn()
    return (lambda: out.copy_(fn())), out


def run_graph_steps(
    device: str, heads: int, kv_heads: int, head_dim: int, page_size: int, graph: Graph
) -> tuple[float, object]:
    """(worst abs error over all steps vs torch_native, the flashinfer backend)."""
    backend = create_attention_backend(
        "flashinfer",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
        page_size=page_size,
        workspace_bytes=128 << 20 if device == "cuda" else 1024,
    )

    def builder(attn_backend) -> ForwardBatchBuilder:
        return ForwardBatchBuilder(
            2,
            kv_heads,
            head_dim,
            dtype=torch.bfloat16,
            num_slots=1 << 14,
            max_reqs=8,
            max_context_len=1024,
            backend=attn_backend,
            page_size=page_size,
            device=device,
        )

    ours, ref = builder(backend), builder(TorchNativeAttnBackend())
    layers = [RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, i) for i in range(2)]
    gen = torch.Generator().manual_seed(page_size * 100 + heads)

    def qkv(n: int) -> list[torch.Tensor]:
        dims = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        return [torch.randn(n, d, generator=gen).to(device, torch.bfloat16) for d in dims]

    prompts = [(rid, [0] * (5 + 37 * rid)) for rid in range(8)]
    prefill = qkv(sum(len(ids) for _, ids in prompts))
    for pool in (ours, ref):
        batch = pool.build(prompts)
        for layer in layers:
            layer(*prefill, batch)

    # The graphs' static inputs, padded as the graph runner pads (row 0, one token, slot 0).
    static = {name: torch.zeros(8, dtype=torch.int64, device=device) for name in ("rows", "loc")}
    static["lens"] = torch.ones(8, dtype=torch.int64, device=device)
    q_in, k_in, v_in = (torch.zeros_like(t[:8]) for t in qkv(8))
    backend.init_cuda_graph_state(8, 1024 // page_size)
    batches, replays, outs = {}, {}, {}
    for bs in reversed(SIZES):
        batch = batches[bs] = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=static["rows"][:bs],
            positions=static["rows"][:bs],
            out_cache_loc=static["loc"][:bs],
            req_pool_indices=static["rows"][:bs],
            seq_lens=static["lens"][:bs],
            seq_lens_cpu=[1] * bs,
            req_to_token_pool=ours.req_to_token_pool,
            token_to_kv_pool=ours.kv_pool,
            attn_backend=backend,
        )
        backend.init_forward_metadata_capture_cuda_graph(batch)

        def run(bs: int = bs, batch: ForwardBatch = batch) -> torch.Tensor:
            return torch.stack([layer(q_in[:bs], k_in[:bs], v_in[:bs], batch) for layer in layers])

        replays[bs], outs[bs] = graph(run)

    # Every step's batch and inputs first (the builder writes req_to_token synchronously),
    # then the steps back to back with no host sync.
    steps = [(ours.build([(rid, [0]) for rid in rids]), qkv(len(rids))) for rids in STEPS]
    if device == "cuda":
        torch.cuda.synchronize()
    results = []
    for batch, inputs in steps:
        n = batch.batch_size
        bs = next(s for s in SIZES if s >= n)
        if device == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)
        for buf, src, pad in (
            (static["lens"], batch.seq_lens, 1),
            (static["rows"], batch.req_pool_indices, 0),
            (static["loc"], batch.out_cache_loc, 0),
            *((buf, t, 0) for buf, t in zip((q_in, k_in, v_in), inputs)),
        ):
            buf[:n].copy_(src, non_blocking=True)
            buf[n:bs].fill_(pad)
        batches[bs].seq_lens_cpu = list(batch.seq_lens_cpu) + [1] * (bs - n)
        backend.init_forward_metadata_replay_cuda_graph(batches[bs])
        replays[bs]()
        results.append(outs[bs][:, :n].clone())

    worst = 0.0
    for rids, (_, inputs), got in zip(STEPS, steps, results):
        batch = ref.build([(rid, [0]) for rid in rids])
        want = torch.stack([layer(*inputs, batch) for layer in layers])
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst, backend


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 8), (32, 8)])  # CUDA-core, tensor-core
def test_graph_replays_with_the_host_ahead_match_torch_native(
    page_size: int, heads: int, kv_heads: int
) -> None:
    graph = cuda_graph(torch.cuda.graph_pool_handle())
    worst, backend = run_graph_steps("cuda", heads, kv_heads, 128, page_size, graph)
    assert set(backend.graphs.paths.values()) == {"fast"}, backend.graphs.paths
    assert worst < TOL
    print(f"pinned-buffer guard waits: {backend.guard.waits} of {len(STEPS)} steps")
