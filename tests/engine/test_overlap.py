"""The overlap loop produces exactly the normal loop's greedy tokens, with the default model in
the dtype ``--dtype auto`` picks: on a scaled W1 (the engine-core offline workload's shape:
random prompts of 64-512 tokens, greedy, ignore_eos; fewer prompts, shorter outputs) and on a
scaled-down W2 (shared system prompts, requests arriving while others run, as with
bench_serving's --max-concurrency)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from bench.bench_offline import w1_prompts
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.shared_worker import release

pytestmark = pytest.mark.slow

POOL_TOKENS = 16384  # not 30% of the machine's RAM


@pytest.fixture(scope="module")
def worker() -> Any:
    """One model worker for every run here: both loops take its KV pool in turn, so the
    two runs compared differ in the loop alone (and the model loads once, not four times)."""
    from managers.model_worker import ModelWorker

    return ModelWorker(ServerArgs(max_total_tokens=POOL_TOKENS))


@contextmanager
def driver(worker: Any, overlap: bool) -> Iterator[InProcessDriver]:
    args = ServerArgs(max_total_tokens=POOL_TOKENS, disable_overlap_schedule=not overlap)
    d = InProcessDriver(args, worker=worker)
    try:
        yield d
    finally:
        release(d)


def run_w1(worker: Any, overlap: bool) -> list[list[int]]:
    with driver(worker, overlap) as d:
        prompts = w1_prompts(8, 64, 512, d.scheduler.vocab_size, seed=0)
        outs = d.generate(prompts, {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0})
        d.scheduler.check_memory()
    return [o["output_ids"] for o in outs]


def test_w1_same_tokens_with_and_without_overlap(worker: Any) -> None:
    assert run_w1(worker, overlap=True) == run_w1(worker, overlap=False)


def gsp_prompts(vocab: int, groups: int = 4, per_group: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(vocab) for _ in range(128)]
        prompts += [system + [rng.randrange(vocab) for _ in range(16)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def run_w2_small(worker: Any, overlap: bool, concurrency: int = 6) -> list[list[int]]:
    """Keep `concurrency` requests in flight; a new one arrives when one finishes."""
    with driver(worker, overlap) as d:
        prompts = gsp_prompts(d.scheduler.vocab_size)
        params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
        queue = list(enumerate(prompts))
        live: dict[str, int] = {}
        outs: dict[int, list[int]] = {}
        while queue or live:
            while queue and len(live) < concurrency:
                i, p = queue.pop(0)
                [rid] = d.submit(p, dict(params))
                live[rid] = i
            d.step()
            for rid in [r for r in live if d.outputs[r]["meta_info"].get("finish_reason")]:
                outs[live.pop(rid)] = d.result(rid)["output_ids"]
        d.run_until_idle()
        d.scheduler.check_memory()
        assert d.scheduler.kv.tree.evictable_size() > 0
    return [outs[i] for i in range(len(prompts))]


def test_w2_small_same_tokens_with_and_without_overlap(worker: Any) -> None:
    assert run_w2_small(worker, overlap=True) == run_w2_small(worker, overlap=False)
