"""Scheduler features with a real (tiny, random) model: caching, chunking, retraction,
seeds, n > 1 and logprobs. Every comparison is against a reference run or HF."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.tiny_models import VOCAB, save_tiny_model

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(autouse=True, params=["overlap", "normal"])
def event_loop_kind(request, monkeypatch) -> str:
    """Every feature test runs under both event loops."""
    monkeypatch.setitem(LOOP_ARGS, "disable_overlap_schedule", request.param == "normal")
    return request.param


LOOP_ARGS: dict[str, bool] = {}


def driver_for(path: str, **args) -> InProcessDriver:
    args = {**LOOP_ARGS, **args}
    args.setdefault("max_total_tokens", 8192)
    return InProcessDriver(
        ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, **args)
    )


def rand_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in lengths]


def assert_clean(driver: InProcessDriver) -> None:
    sched = driver.scheduler
    assert sched.is_idle()
    sched.check_memory()
    assert sched.kv.token_usage() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_resubmit_hits_cache_with_identical_output(llama_path: str, page_size: int) -> None:
    driver = driver_for(llama_path, page_size=page_size)
    (p,) = rand_prompts([101])
    first = driver.generate([p], {"max_new_tokens": 16, **GREEDY})[0]
    again = driver.generate([p], {"max_new_tokens": 16, **GREEDY})[0]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] >= (len(p) - 1) // page_size * page_size
    assert again["output_ids"] == first["output_ids"]
    assert_clean(driver)


def test_shared_system_prompt_same_round(llama_path: str) -> None:
    driver = driver_for(llama_path)
    (system,) = rand_prompts([120], seed=1)
    ps = [system + q for q in rand_prompts([5, 9, 14, 20], seed=2)]
    outs = driver.generate(ps, {"max_new_tokens": 8, **GREEDY})
    solo = [driver_for(llama_path).generate([p], {"max_new_tokens": 8, **GREEDY})[0] for p in ps]
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and all(c >= len(system) for c in cached[1:])
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in solo]


def test_chunked_prefill_300_tokens(llama_path: str) -> None:
    ps = rand_prompts([300, 300, 300], seed=3)
    plain = driver_for(llama_path, chunked_prefill_size=-1).generate(
        ps, {"max_new_tokens": 16, **GREEDY}
    )
    chunked_driver = driver_for(llama_path, chunked_prefill_size=32)
    chunked = chunked_driver.generate(ps, {"max_new_tokens": 16, **GREEDY})
    assert [o["output_ids"] for o in chunked] == [o["output_ids"] for o in plain]
    assert_clean(chunked_driver)


def test_retraction_gives_same_outputs(llama_path: str, caplog) -> None:
    # The admission reserve (new_token_ratio * max_new_tokens) underestimates growth here,
    # so the running requests outgrow the pool and some must be retracted.
    ps = rand_prompts([30, 40, 35, 45, 32, 38, 42, 36], seed=4)
    params = {"max_new_tokens": 64, **GREEDY}
    roomy = driver_for(llama_path).generate(ps, params)
    tight = driver_for(llama_path, max_total_tokens=400)
    with caplog.at_level(logging.WARNING):
        outs = tight.generate(ps, params)
    assert tight.scheduler.decode.num_retracted_reqs > 0
    assert "KV cache pool is full. Retract requests." in caplog.text
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in roomy]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert_clean(tight)


def test_impossible_request_does_not_disturb_others(llama_path: str) -> None:
    ok = rand_prompts([30, 40], seed=5)
    driver = driver_for(llama_path, max_total_tokens=256)
    outs = driver.generate(ok + rand_prompts([500], seed=6), {"max_new_tokens": 8, **GREEDY})
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    ref = driver_for(llama_path).generate(ok, {"max_new_tokens": 8, **GREEDY})
    assert [o["output_ids"] for o in outs[:-1]] == [o["output_ids"] for o in ref]
    assert_clean(driver)


def test_seeded_sampling_independent_of_batch(llama_path: str) -> None:
    target = rand_prompts([33], seed=7)[0]
    params = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    alone = driver_for(llama_path).generate([target], params)[0]["output_ids"]
    others = rand_prompts([10, 50, 90, 20, 70], seed=8)
    mixed_params = [{"max_new_tokens": 30, "temperature": 1.0}] * 3 + [params] + [GREEDY] * 3
    batch = others[:3] + [target] + others[3:] + [target[:5]]
    mixed = driver_for(llama_path).generate(batch, mixed_params)
    assert mixed[3]["output_ids"] == alone
    reordered = driver_for(llama_path, chunked_prefill_size=16).generate(
        [target] + others[::-1], [params] + [{"max_new_tokens": 5, "temperature": 0.7}] * 5
    )
    assert reordered[0]["output_ids"] == alone
    other_seed = driver_for(llama_path).generate([target], {**params, "seed": 99})[0]
    assert other_seed["output_ids"] != alone


def test_parallel_sampling_n(llama_path: str) -> None:
    driver = driver_for(llama_path)
    (p,) = rand_prompts([64], seed=9)
    outs = driver.generate([p], {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "seed": 5})
    assert len(outs) == 4
    assert all(o["meta_info"]["cached_tokens"] >= len(p) - 1 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    again = driver_for(llama_path).generate(
        [p], {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "seed": 5}
    )
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert_clean(driver)


@pytest.mark.parametrize("start", [0, 5, 40])
def test_logprobs_match_hf(llama_path: str, start: int) -> None:
    from transformers import AutoModelForCausalLM

    (p,) = rand_prompts([48], seed=10)
    # A cached copy of the prompt must not hide the positions whose logprobs are asked for.
    driver = driver_for(llama_path, chunked_prefill_size=16)
    driver.generate([p], {"max_new_tokens": 1, **GREEDY})
    out = driver.generate(
        [p],
        {"max_new_tokens": 6, **GREEDY},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
    )[0]
    meta = out["meta_info"]
    hf = AutoModelForCausalLM.from_pretrained(Path(llama_path), dtype=torch.float32).eval()
    full = p + out["output_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    inputs = meta["input_token_logprobs"]
    assert [t for _, t in inputs] == p[start:]
    for offset, (value, token) in enumerate(inputs):
        pos = start + offset
        if pos == 0:
            assert value is None
        else:
            assert value == pytest.approx(float(ref[pos - 1, token]), abs=1e-4)
    outputs = meta["output_token_logprobs"]
    assert [t for _, t in outputs] == out["output_ids"]
    for i, (value, token) in enumerate(outputs):
        assert value == pytest.approx(float(ref[len(p) - 1 + i, token]), abs=1e-4)
        top = meta["output_top_logprobs"][i]
        ref_top = torch.topk(ref[len(p) - 1 + i], 3)
        assert [t for _, t in top] == ref_top.indices.tolist()
        assert [v for v, _ in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)
    assert len(meta["input_top_logprobs"]) == len(inputs)
    assert_clean(driver)


def test_logprobs_of_requests_decoded_in_mixed_batches(llama_path: str) -> None:
    """With `--enable-mixed-chunk` and a small prefill budget, requests decode inside MIXED
    batches while others prefill: their logprobs equal those of the unmixed run."""
    prompts = rand_prompts([40, 33, 47, 29], seed=11)
    fields = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    params = {"max_new_tokens": 8, **GREEDY}
    base = driver_for(llama_path).generate(prompts, params, **fields)
    mixed_driver = driver_for(llama_path, enable_mixed_chunk=True, max_prefill_tokens=32)
    modes = []
    forward = mixed_driver.worker.forward_batch_generation

    def recording_forward(mwb):
        modes.append(mwb.forward_mode)
        return forward(mwb)

    mixed_driver.worker.forward_batch_generation = recording_forward
    mixed = mixed_driver.generate(prompts, params, **fields)
    assert any(m.is_mixed() for m in modes)
    for a, b in zip(base, mixed, strict=True):
        assert b["output_ids"] == a["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
            assert_close_nested(b["meta_info"][key], a["meta_info"][key])
    assert_clean(mixed_driver)


def assert_close_nested(got, want) -> None:
    """Lists of (logprob, token) pairs, or lists of such lists: same shape, same tokens,
    logprobs within 1e-5 (None where there is none)."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_close_nested(g, w)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5)
    else:
        assert got == want
