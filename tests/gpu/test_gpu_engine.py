"""The GPU path end to end: graph replay equals eager, greedy outputs of the default model
with flashinfer + CUDA graphs equal torch_native's, and no KV leaks after a W1-style run."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.server_args import ServerArgs

pytestmark = pytest.mark.gpu

NEW_TOKENS = 48
# At the first position where two bf16 runs differ, our token must be among the reference's
# top 5 and at most this far below the reference's own pick in logprob: a tie that kernel
# rounding may flip, not a wrong token. bf16 logits of magnitude 16-32 lie 0.125 apart, so
# this is two such steps. On the H200 all six first partings were 0 or 0.125 apart, and
# torch_native itself parts from torch_native when the batch around a request changes.
BF16_NEAR_TIE = 0.25


def w1_prompts(num: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


GIB = 2**30


@contextmanager
def driver(**kw) -> Iterator[InProcessDriver]:
    """A bf16 CUDA driver whose model, pools and graphs are freed on exit, so the next
    test's memory profile starts from an empty device."""
    kw.setdefault("max_total_tokens", 65536)
    args = ServerArgs(dtype="bfloat16", device="cuda", skip_tokenizer_init=True, **kw)
    d = InProcessDriver(args)
    try:
        yield d
    finally:
        forward_worker = getattr(d.scheduler, "forward_worker", None)
        if forward_worker is not None:
            forward_worker.close(timeout=30)
        del d, forward_worker
        gc.collect()
        torch.cuda.empty_cache()


def greedy(d: InProcessDriver, prompts: list[list[int]], logprobs: bool = False):
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    extra = {"return_logprob": True, "top_logprobs_num": 5} if logprobs else {}
    outs = d.generate(prompts, params, **extra)
    d.scheduler.check_memory()
    return outs


def assert_same_greedy(ours: list[int], ref: dict) -> None:
    ref_ids = ref["output_ids"]
    assert len(ours) == len(ref_ids)
    for pos, (a, b) in enumerate(zip(ours, ref_ids, strict=True)):
        if a != b:
            top = {tok: lp for lp, tok in ref["meta_info"]["output_top_logprobs"][pos]}
            assert a in top, f"position {pos}: {a} is not in the reference's top {len(top)}"
            gap = top[b] - top[a]
            assert gap <= BF16_NEAR_TIE, f"position {pos}: {a} vs {b}, logprob gap {gap:.3f}"
            return


@pytest.fixture(scope="module")
def torch_native_reference(default_model_path: str):
    with driver(model_path=default_model_path, attention_backend="torch_native") as d:
        prompts = w1_prompts(16, 3, 300, d.scheduler.vocab_size, seed=1)
        prompts += [prompts[0][:50] + p[:20] for p in prompts[:4]]  # shared prefixes
        return prompts, greedy(d, prompts, logprobs=True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 16},
        {"disable_cuda_graph": True},
        {"disable_overlap_schedule": True},
        {"cuda_graph_max_bs": 4},  # large decode batches run eagerly, small ones replay
    ],
)
def test_flashinfer_graphs_greedy_equal_torch_native(
    default_model_path: str, torch_native_reference, options: dict
) -> None:
    prompts, reference = torch_native_reference
    with driver(model_path=default_model_path, attention_backend="flashinfer", **options) as d:
        runner = d.worker.model_runner.cuda_graph_runner
        assert (runner is None) == options.get("disable_cuda_graph", False)
        outs = greedy(d, prompts)
    for out, ref in zip(outs, reference, strict=True):
        assert_same_greedy(out["output_ids"], ref)


def test_auto_picks_flashinfer_with_graphs(default_model_path: str) -> None:
    with driver(model_path=default_model_path, max_running_requests=8) as d:
        runner = d.worker.model_runner
        assert runner.attn_backend_name == "flashinfer"
        assert isinstance(runner.cuda_graph_runner, CudaGraphRunner)
        assert runner.cuda_graph_runner.batch_sizes == [1, 2, 4, 8]


@pytest.mark.parametrize("page_size", [1, 16])
def test_w1_run_keeps_memory_integrity(default_model_path: str, page_size: int) -> None:
    with driver(
        model_path=default_model_path,
        attention_backend="flashinfer",
        page_size=page_size,
        max_total_tokens=16384,  # small pool: retractions and evictions happen too
    ) as d:
        prompts = w1_prompts(64, 64, 512, d.scheduler.vocab_size)
        params = {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0}
        outs = d.generate(prompts, params)
        assert all(len(o["output_ids"]) == 128 for o in outs)
        d.scheduler.check_memory()
        assert d.scheduler.flush_cache()
        allocator = d.worker.model_runner.allocator
        assert allocator.available_size() == allocator.size


def test_profiled_pool_fills_the_fraction(default_model_path: str) -> None:
    # What earlier tests left for the collector would be freed inside the runner's profile
    # and counted there, not here (on the H200 the pool came out 0.6 GB over this budget).
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    budget = 0.88 * total - (total - free0)  # the static budget left before loading
    with driver(
        model_path=default_model_path, attention_backend="flashinfer", max_total_tokens=None
    ) as d:
        pool = d.worker.model_runner.token_to_kv_pool.get_kv_size_bytes()
        free, _ = torch.cuda.mem_get_info()
    # Weights (0.3 GiB), workspace, the profiled prefill peak and the sampler reserve come
    # out of the budget; the pool gets the rest, and the 12% headroom stays free.
    assert budget - 4 * GIB < pool < budget
    assert free > 0.05 * total


def test_sampled_requests_with_penalties_and_bias_run_on_cuda(default_model_path: str) -> None:
    """Non-greedy rows read the batch's sampling tensors (temperatures, penalties, bias), which
    the scheduler builds on the CPU: they must reach the logits' device. Seeded draws repeat,
    +100 bias forces its token, and the pool is whole afterwards."""
    with driver(model_path=default_model_path) as d:
        prompts = w1_prompts(4, 8, 64, d.scheduler.vocab_size, seed=3)
        params = {
            "max_new_tokens": 16,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 5,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.3,
            "ignore_eos": True,
        }
        first = [o["output_ids"] for o in d.generate(prompts, params)]
        assert first == [o["output_ids"] for o in d.generate(prompts, params)]
        forced = d.generate(prompts[:1], {**params, "logit_bias": {"42": 100}})[0]
        assert set(forced["output_ids"]) == {42}
        d.scheduler.check_memory()
