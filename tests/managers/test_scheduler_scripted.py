"""The scheduler driven by the scripted worker: caching, chunking, retraction, aborts.

The scripted worker's next token is a hash of the whole sequence it reads back through
`req_to_token`, so every output is checked against `scripted_output` computed directly.
"""

from __future__ import annotations

import logging
import random

import pytest

from managers.inprocess import InProcessDriver
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.managers.scripted_worker import (
    ScriptedModelConfig,
    ScriptedWorker,
    assert_idle_and_clean,
    first_token_order,
    scripted_output,
)


@pytest.fixture(autouse=True, params=["overlap", "normal"])
def event_loop_kind(request, monkeypatch) -> str:
    """Every test runs under both event loops."""
    monkeypatch.setitem(LOOP_ARGS, "disable_overlap_schedule", request.param == "normal")
    return request.param


LOOP_ARGS: dict[str, bool] = {}


def make_driver(
    max_total_tokens: int = 4096,
    page_size: int = 1,
    max_running_requests: int = 64,
    **args,
) -> InProcessDriver:
    server_args = ServerArgs(page_size=page_size, **{**LOOP_ARGS, **args})
    worker = ScriptedWorker(max_total_tokens, max_running_requests, page_size)
    return InProcessDriver(server_args, worker=worker, tokenizer=None)


def prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_continuous_batch_matches_script(page_size: int, policy: str) -> None:
    driver = make_driver(page_size=page_size, schedule_policy=policy)
    ps = prompts(12, 5, 80)
    outs = driver.generate(ps, SamplingParams(max_new_tokens=16, temperature=0))
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 16)
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
        assert o["meta_info"]["prompt_tokens"] == len(p)
    assert_idle_and_clean(driver)


@pytest.mark.parametrize("page_size", [1, 4])
def test_resubmitted_prompt_hits_cache(page_size: int) -> None:
    driver = make_driver(page_size=page_size)
    p = prompts(1, 50, 50)[0]
    first = driver.generate([p], {"max_new_tokens": 8})[0]
    second = driver.generate([p], {"max_new_tokens": 8})[0]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= (len(p) - 1) // page_size * page_size
    assert second["output_ids"] == first["output_ids"]
    assert_idle_and_clean(driver)


def test_shared_system_prompt_in_one_round_hits_cache() -> None:
    driver = make_driver()
    system = prompts(1, 200, 200, seed=1)[0]
    questions = prompts(6, 10, 20, seed=2)
    ps = [system + q for q in questions]
    outs = driver.generate(ps, {"max_new_tokens": 4})
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    # One request computes the system prompt; the others are held back a round and hit it.
    assert cached[0] == 0
    assert all(c >= len(system) for c in cached[1:])
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 4)
    assert_idle_and_clean(driver)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompt_that_unblocks_most_requests_goes_first(page_size: int) -> None:
    # Three uncached system prompts: x with one request, y with three, z with two. The
    # prefill budget takes one uncached prompt (plus cached questions) per batch, so the
    # order of the uncached prompts is the order of the first tokens.
    driver = make_driver(page_size=page_size, schedule_policy="lpm", max_prefill_tokens=64)
    order = first_token_order(driver)
    head = driver.submit(prompts(1, 8, 8, seed=9)[0], {"max_new_tokens": 2}, rid="head")
    driver.step()  # runs alone; the rest queue behind it
    system = dict(zip("xyz", prompts(3, 40, 40, seed=3), strict=True))
    questions = iter(prompts(6, 4, 4, seed=4))
    ps = {}
    for rid in ("x1", "y1", "y2", "y3", "z1", "z2"):  # arrival order
        ps[rid] = system[rid[0]] + next(questions)
        driver.submit(ps[rid], {"max_new_tokens": 2}, rid=rid)
    driver.run_until_idle()
    assert order == head + ["y1", "y2", "y3", "z1", "z2", "x1"]
    for rid, p in ps.items():
        assert driver.result(rid)["output_ids"] == scripted_output(p, 2)
    assert_idle_and_clean(driver)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_same_tokens(page_size: int) -> None:
    ps = prompts(4, 300, 300, seed=3)
    chunked = make_driver(page_size=page_size, chunked_prefill_size=32)
    outs = chunked.generate(ps, {"max_new_tokens": 8})
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 8)
    extend_calls = [c for c in chunked.worker.forward_calls if c.forward_mode.is_extend()]
    assert max(sum(c.extend_lens()) for c in extend_calls) <= 32
    assert len(extend_calls) >= 4 * 300 // 32
    assert_idle_and_clean(chunked)


def test_mixed_chunk_same_tokens() -> None:
    ps = prompts(6, 100, 200, seed=4)
    driver = make_driver(chunked_prefill_size=64, enable_mixed_chunk=True)
    outs = driver.generate(ps, {"max_new_tokens": 12})
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 12)
    assert any(c.forward_mode.is_mixed() for c in driver.worker.forward_calls)
    assert_idle_and_clean(driver)


def test_mixed_batches_without_chunking() -> None:
    """As in SGLang, `--enable-mixed-chunk` runs the running decodes with every prefill batch,
    not only with a chunk; their tokens count against `--max-prefill-tokens` (beyond the
    first prompt, which is always admitted)."""
    ps = prompts(8, 25, 29, seed=7)
    driver = make_driver(max_prefill_tokens=60, enable_mixed_chunk=True)
    outs = driver.generate(ps, {"max_new_tokens": 12})
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 12)
    mixed = [c for c in driver.worker.forward_calls if c.forward_mode.is_mixed()]
    assert len(mixed) >= 3
    for call in mixed:
        new = [n for n in call.extend_lens() if n > 1]  # prompts: 25..29 tokens
        decodes = len(call.extend_lens()) - len(new)
        assert decodes > 0 and (len(new) == 1 or sum(new) + decodes <= 60)
    assert_idle_and_clean(driver)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_completes_every_request(page_size: int, caplog) -> None:
    ps = prompts(8, 40, 60, seed=5)
    driver = make_driver(max_total_tokens=320, page_size=page_size)
    with caplog.at_level(logging.WARNING):
        outs = driver.generate(ps, {"max_new_tokens": 40})
    assert driver.scheduler.decode.num_retracted_reqs > 0
    assert "KV cache pool is full. Retract requests. #retracted_reqs:" in caplog.text
    for p, o in zip(ps, outs, strict=True):
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert o["output_ids"] == scripted_output(p, 40)
    assert_idle_and_clean(driver)


def test_impossible_request_fails_alone() -> None:
    driver = make_driver(max_total_tokens=256)
    ok = prompts(3, 20, 30, seed=6)
    too_long = prompts(1, 400, 400, seed=7)[0]
    outs = driver.generate(ok + [too_long], {"max_new_tokens": 10})
    bad = outs[-1]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and "never fit" in bad["message"]
    for p, o in zip(ok, outs[:-1], strict=True):
        assert o["output_ids"] == scripted_output(p, 10)
    assert_idle_and_clean(driver)


def test_request_outgrowing_the_pool_is_finished_with_error() -> None:
    driver = make_driver(max_total_tokens=128)
    p = prompts(1, 100, 100, seed=8)[0]
    out = driver.generate([p], {"max_new_tokens": 100})[0]
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "too small" in reason["message"]
    assert out["output_ids"] == scripted_output(p, len(out["output_ids"]))
    assert_idle_and_clean(driver)


def test_abort_waiting_and_running() -> None:
    driver = make_driver(max_running_requests=2)
    ps = prompts(4, 20, 30, seed=9)
    rids = [driver.submit(p, {"max_new_tokens": 50})[0] for p in ps]
    driver.step()  # admits the first two
    driver.step()
    driver.abort(rids[0])  # running
    driver.abort(rids[3])  # waiting
    driver.run_until_idle()
    for i in (0, 3):
        assert driver.result(rids[i])["meta_info"]["finish_reason"]["type"] == "abort"
    for i in (1, 2):
        assert driver.result(rids[i])["output_ids"] == scripted_output(ps[i], 50)
    assert_idle_and_clean(driver)


def test_stop_conditions() -> None:
    driver = make_driver()
    p = prompts(1, 10, 10, seed=10)[0]
    full = scripted_output(p, 20)
    stop_tok = full[5]
    out = driver.generate([p], {"max_new_tokens": 20, "stop_token_ids": [stop_tok]})[0]
    assert out["output_ids"] == full[: full.index(stop_tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    out = driver.generate(
        [p], {"max_new_tokens": 20, "stop_token_ids": [stop_tok], "min_new_tokens": 20}
    )[0]
    assert len(out["output_ids"]) == 20 or stop_tok in full[: full.index(stop_tok)]
    assert_idle_and_clean(driver)


def test_context_length_stops_generation() -> None:
    worker = ScriptedWorker(model_config=ScriptedModelConfig(context_len=40))
    driver = InProcessDriver(ServerArgs(**LOOP_ARGS), worker=worker, tokenizer=None)
    p = prompts(1, 30, 30, seed=11)[0]
    out = driver.generate([p], {"max_new_tokens": 100})[0]
    assert len(p) + len(out["output_ids"]) == 40
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    too_long = driver.generate([prompts(1, 45, 45)[0]], {"max_new_tokens": 5})[0]
    assert too_long["meta_info"]["finish_reason"]["type"] == "abort"


def test_parallel_sampling_shares_prompt() -> None:
    driver = make_driver()
    p = prompts(1, 64, 64, seed=12)[0]
    outs = driver.generate([p], {"max_new_tokens": 6, "n": 3})
    assert len(outs) == 3
    for o in outs:
        assert o["meta_info"]["cached_tokens"] >= len(p) - 1
        assert o["output_ids"] == scripted_output(p, 6)
    assert_idle_and_clean(driver)


def test_disable_radix_cache() -> None:
    driver = make_driver(disable_radix_cache=True, chunked_prefill_size=32)
    ps = prompts(5, 20, 100, seed=13)
    outs = driver.generate(ps + ps[:1], {"max_new_tokens": 10})
    for p, o in zip(ps + ps[:1], outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 10)
        assert o["meta_info"]["cached_tokens"] == 0
    assert driver.scheduler.kv.allocator.available_size() == 4096


def test_flush_cache_returns_every_slot() -> None:
    driver = make_driver()
    p = prompts(1, 50, 50)[0]
    driver.generate([p], {"max_new_tokens": 8})
    assert driver.scheduler.kv.tree.evictable_size() > 0
    assert driver.scheduler.flush_cache()
    assert driver.scheduler.kv.tree.evictable_size() == 0
    assert driver.scheduler.kv.allocator.available_size() == 4096
    again = driver.generate([p], {"max_new_tokens": 8})[0]
    assert again["meta_info"]["cached_tokens"] == 0
    assert_idle_and_clean(driver)


def test_paged_admission_counts_whole_pages() -> None:
    """Five 9-token prompts fit in 64 tokens but need five 16-token pages; there are four."""
    driver = make_driver(max_total_tokens=64, page_size=16)
    ps = prompts(5, 9, 9, seed=100)
    outs = driver.generate(ps, {"max_new_tokens": 2})
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == scripted_output(p, 2)
    first_prefill = next(c for c in driver.worker.forward_calls if c.forward_mode.is_extend())
    assert len(first_prefill.seq_lens) <= 4
    assert_idle_and_clean(driver)


def test_not_idle_between_prefill_and_first_decode() -> None:
    """The server loop sleeps on its socket while idle; a request that has just prefilled
    (still in `last_batch`, not yet merged into the running batch) must keep it awake."""
    driver = make_driver()
    driver.submit(prompts(1, 10, 10)[0], SamplingParams(max_new_tokens=4))
    assert not driver.scheduler.is_idle()
    assert driver.step()  # the prefill
    assert not driver.scheduler.is_idle()
    driver.run_until_idle()
    assert driver.scheduler.is_idle()


def test_load_counts_a_request_between_prefill_and_first_decode() -> None:
    """/get_load and the stats count running requests: one whose prefill is in flight (not
    yet merged into the running batch in the overlap loop) is running, not gone."""
    driver = make_driver(max_running_requests=1)
    driver.submit(prompts(1, 10, 10)[0], SamplingParams(max_new_tokens=8))
    driver.submit(prompts(1, 10, 10, seed=1)[0], SamplingParams(max_new_tokens=8))
    assert driver.step()  # the first prefill; the second request waits for a row
    state = driver.scheduler.internal_state()
    assert (state.num_running_reqs, state.num_queue_reqs) == (1, 1)
    driver.run_until_idle()
    state = driver.scheduler.internal_state()
    assert (state.num_running_reqs, state.num_queue_reqs) == (0, 0)
    assert_idle_and_clean(driver)


def test_abort_reaches_a_request_that_just_prefilled() -> None:
    driver = make_driver()
    [rid] = driver.submit(prompts(1, 10, 10)[0], SamplingParams(max_new_tokens=50))
    assert driver.step()  # prefill; the request sits in last_batch
    driver.abort(rid)
    driver.run_until_idle()
    out = driver.result(rid)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 50
    assert driver.scheduler.intake.num_aborted_reqs == 1
    assert_idle_and_clean(driver)


def test_the_other_loop_on_the_same_worker_gets_every_row_back() -> None:
    """`bench_gpu` runs one worker under the overlap loop, then under the normal loop. On the
    H200 the normal loop's scheduler inherited the overlap loop's hold on freed rows: no row
    came back, and with every row taken one request waited forever. Here each loop hands the
    worker to the other; three prompts on two rows need the rows back."""
    worker = ScriptedWorker(max_running_requests=2)
    ps = prompts(3, 5, 20, seed=4)
    params = {"max_new_tokens": 4, "temperature": 0}
    first = InProcessDriver(ServerArgs(**LOOP_ARGS), worker=worker, tokenizer=None)
    first.generate(ps, params)
    forward_worker = getattr(first.scheduler, "forward_worker", None)
    if forward_worker is not None:
        forward_worker.stop()
    assert first.scheduler.flush_cache()
    other_loop = {"disable_overlap_schedule": not LOOP_ARGS["disable_overlap_schedule"]}
    second = InProcessDriver(ServerArgs(**other_loop), worker=worker, tokenizer=None)
    outs = second.generate(ps, params)
    assert [o["output_ids"] for o in outs] == [scripted_output(p, 4) for p in ps]
    assert second.scheduler.kv.free_rows() == 2
    assert_idle_and_clean(second)
