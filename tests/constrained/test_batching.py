"""Constrained requests under the scheduler's batching: mixed with unconstrained ones, under
both event loops, and through retraction when the KV pool runs short."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.constrained.grammars import ARITH, REGEXES, parse_arith
from tests.constrained.helpers import assert_stopped_at_eos, assert_valid_json, chat
from tests.constrained.schemas import SCHEMAS
from tests.engine.shared_worker import driver_on, release

pytestmark = pytest.mark.slow

FREE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
    "List three fruits.",
    "Who wrote Romeo and Juliet?",
    "Tell me a fun fact about cats.",
]


# float32 for the equality tests below: in bfloat16 a request's logits can change with the
# batch it runs in (different matmul blocking), which would flip greedy tokens for reasons
# that have nothing to do with grammars. Both drivers run on the session's float32 worker.
@pytest.fixture(scope="module")
def fp32_overlap(default_worker: Any) -> Iterator[InProcessDriver]:
    with driver_on(default_worker, disable_overlap_schedule=False) as d:  # also on CPU
        yield d


@pytest.fixture(scope="module")
def fp32_normal(default_worker: Any) -> Iterator[InProcessDriver]:
    with driver_on(default_worker, disable_overlap_schedule=True) as d:
        yield d


# A 260-token pool and a low reservation for future decode tokens: the four requests of the
# retraction test are admitted together, then outgrow the pool as their JSON gets longer
# (each loop retracts twice). One worker for both loops.
RETRACT_POOL = 260


@pytest.fixture(scope="module")
def small_pool_worker() -> Any:
    from managers.model_worker import ModelWorker

    return ModelWorker(ServerArgs(max_total_tokens=RETRACT_POOL))


def constrained_requests(driver: InProcessDriver) -> tuple[list[str], list[dict]]:
    """Five schemas, two regexes and an EBNF grammar, greedy and seeded-sampled."""
    prompts, params = [], []
    for temperature in (0.0, 0.8):
        start = len(params)
        for desc, schema in SCHEMAS[::4]:
            prompts.append(chat(driver, f"Give me a JSON object describing {desc}."))
            params.append({"json_schema": json.dumps(schema)})
        for regex, prompt in REGEXES[:2]:
            prompts.append(chat(driver, prompt))
            params.append({"regex": regex})
        prompts.append(chat(driver, "Write an arithmetic expression that equals 24."))
        params.append({"ebnf": ARITH})
        for p in params[start:]:
            p.update(max_new_tokens=256, temperature=temperature, seed=7)
    return prompts, params


def check_constrained(driver: InProcessDriver, outs: list[dict], params: list[dict]) -> None:
    for out, p in zip(outs, params, strict=True):
        if "json_schema" in p:
            assert_valid_json(driver, out, json.loads(p["json_schema"]))
            continue
        assert_stopped_at_eos(driver, out)
        if "regex" in p:
            assert re.fullmatch(p["regex"], out["text"]), (p["regex"], out["text"])
        else:
            parse_arith(out["text"])


def test_unconstrained_outputs_unchanged_by_constrained_neighbours(
    fp32_overlap: InProcessDriver,
) -> None:
    d = fp32_overlap
    free_prompts = [chat(d, p) for p in FREE_PROMPTS]
    free_params = {"max_new_tokens": 48, "temperature": 0}
    alone = d.generate(free_prompts, free_params)
    # Recompute the prompts rather than hit the prefix cache, so only the batch differs.
    assert d.scheduler.flush_cache()

    prompts, params = constrained_requests(d)
    # Interleave: the unconstrained rows sit between constrained rows of every batch.
    mixed_prompts, mixed_params, where = [], [], []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        mixed_prompts.append(prompt)
        mixed_params.append(p)
        if i % 3 == 0 and len(where) < len(free_prompts):
            where.append(len(mixed_prompts))
            mixed_prompts.append(free_prompts[len(where) - 1])
            mixed_params.append(free_params)
    outs = d.generate(mixed_prompts, mixed_params)

    assert [outs[i]["output_ids"] for i in where] == [o["output_ids"] for o in alone]
    constrained = [o for i, o in enumerate(outs) if i not in where]
    check_constrained(d, constrained, params)
    d.scheduler.check_memory()


def test_both_loops_give_the_same_constrained_outputs(
    fp32_overlap: InProcessDriver, fp32_normal: InProcessDriver
) -> None:
    prompts, params = constrained_requests(fp32_overlap)
    outs = {}
    for name, d in (("overlap", fp32_overlap), ("normal", fp32_normal)):
        assert d.scheduler.flush_cache()
        outs[name] = d.generate(prompts, params)
        check_constrained(d, outs[name], params)
        d.scheduler.check_memory()
    assert [o["output_ids"] for o in outs["overlap"]] == [o["output_ids"] for o in outs["normal"]]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_retracted_constrained_requests_stay_valid(small_pool_worker: Any, overlap: bool) -> None:
    args = ServerArgs(
        max_total_tokens=RETRACT_POOL,
        schedule_conservativeness=0.1,
        disable_overlap_schedule=not overlap,
    )
    d = InProcessDriver(args, worker=small_pool_worker)
    schemas = [SCHEMAS[19], SCHEMAS[14]]  # the longest outputs: arrays of objects
    prompts, params = [], []
    for i in range(4):
        desc, schema = schemas[i % 2]
        prompts.append(chat(d, f"Give me a JSON object describing {desc}."))
        params.append(
            {
                "max_new_tokens": 256,
                "temperature": 0.8,
                "seed": i,
                "json_schema": json.dumps(schema),
            }
        )
    outs = d.generate(prompts, params)
    assert d.scheduler.decode.num_retracted_reqs > 0
    for i, out in enumerate(outs):
        assert_valid_json(d, out, schemas[i % 2][1])
    d.scheduler.check_memory()
    release(d)
