"""Scheduler defaults that depend on the device.

- The event loop: by default the normal loop on CPU (the forward's threads already take every
  core, so the overlap loop's scheduler thread only slows them) and the overlap loop on GPU;
  `--disable-overlap-schedule` and `--enable-overlap-schedule` choose.
- The prefill-token budget of one batch: 384 on CPU (prefill throughput is nearly flat beyond
  a few hundred tokens), raised to an eighth of a long waiting queue's new tokens up to 2048;
  SGLang's 16384 on GPU; `--max-prefill-tokens` pins it."""

from __future__ import annotations

import pytest

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from srt.server_args_cli import prepare_server_args
from tests.managers.scripted_worker import ScriptedWorker, assert_idle_and_clean


@pytest.mark.parametrize(
    ("flags", "device", "overlap"),
    [
        ([], "cpu", False),
        ([], "cuda", True),
        (["--disable-overlap-schedule"], "cpu", False),
        (["--disable-overlap-schedule"], "cuda", False),
        (["--enable-overlap-schedule"], "cpu", True),
        (["--enable-overlap-schedule"], "cuda", True),
    ],
)
def test_flags_and_device_choose_the_loop(flags: list[str], device: str, overlap: bool) -> None:
    args = prepare_server_args([*flags, "--device", device])
    assert args.overlap_schedule() is overlap


def test_unset_is_none_and_each_flag_sets_the_field() -> None:
    assert prepare_server_args([]).disable_overlap_schedule is None
    assert prepare_server_args(["--disable-overlap-schedule"]).disable_overlap_schedule is True
    assert prepare_server_args(["--enable-overlap-schedule"]).disable_overlap_schedule is False


@pytest.mark.parametrize(
    ("args", "overlap"),
    [
        (ServerArgs(device="cpu"), False),
        (ServerArgs(device="cpu", disable_overlap_schedule=False), True),
        (ServerArgs(device="cpu", disable_overlap_schedule=True), False),
    ],
)
def test_cpu_scheduler_runs_the_chosen_loop(args: ServerArgs, overlap: bool) -> None:
    """The scheduler on a CPU worker (the scripted test double) builds the forward thread only
    for the overlap loop, and either loop serves requests and ends clean."""
    driver = InProcessDriver(args, worker=ScriptedWorker(), tokenizer=None)
    sched = driver.scheduler
    assert sched.overlap is overlap
    assert hasattr(sched, "forward_worker") is overlap
    outs = driver.generate([[1, 2, 3, 4], [5, 6, 7]], {"max_new_tokens": 5, "ignore_eos": True})
    assert [len(o["output_ids"]) for o in outs] == [5, 5]
    assert_idle_and_clean(driver)


@pytest.mark.parametrize(
    ("flags", "device", "budget"),
    [
        ([], "cpu", 384),
        ([], "cuda", 16384),
        (["--max-prefill-tokens", "300"], "cpu", 300),
        (["--max-prefill-tokens", "300"], "cuda", 300),
    ],
)
def test_prefill_budget_by_device(flags: list[str], device: str, budget: int) -> None:
    assert prepare_server_args([*flags, "--device", device]).prefill_token_budget() == budget


@pytest.mark.parametrize(
    ("flags", "device", "queued", "budget"),
    [
        ([], "cpu", 3071, 384),  # under 8 x 384: the default
        ([], "cpu", 4000, 500),  # an eighth of the queue
        ([], "cpu", 16384, 2048),
        ([], "cpu", 100_000, 2048),  # the cap
        ([], "cuda", 100_000, 16384),  # the GPU's default does not move
        (["--max-prefill-tokens", "300"], "cpu", 100_000, 300),  # pinned
    ],
)
def test_prefill_budget_grows_with_the_queue_on_cpu(
    flags: list[str], device: str, queued: int, budget: int
) -> None:
    args = prepare_server_args([*flags, "--device", device])
    assert args.prefill_token_budget(queued) == budget


def extend_sizes(worker: ScriptedWorker) -> list[int]:
    """Requests per prefill batch, in order."""
    return [len(b.seq_lens) for b in worker.forward_calls if b.forward_mode.is_extend()]


def test_a_long_queue_prefills_in_larger_batches_that_shrink_with_it() -> None:
    """64 prompts of 250 tokens waiting at once (16000 new tokens): the first batch's budget
    is 2000 tokens (8 prompts), each later one an eighth of what is left, down to 384 (one
    prompt a batch); every prompt is served. Pinned to 384, every batch holds one."""
    prompts = [[(i * 31 + k) % 900 + 1 for k in range(250)] for i in range(64)]
    sizes = {}
    for pinned in (None, 384):
        worker = ScriptedWorker(max_total_tokens=20000)
        args = ServerArgs(device="cpu", max_prefill_tokens=pinned)
        driver = InProcessDriver(args, worker=worker, tokenizer=None)
        outs = driver.generate(prompts, {"max_new_tokens": 2, "ignore_eos": True})
        assert all(len(o["output_ids"]) == 2 for o in outs)
        assert_idle_and_clean(driver)
        sizes[pinned] = extend_sizes(worker)
    assert sizes[384] == [1] * 64
    grown = sizes[None]
    assert sum(grown) == 64
    # Left n prompts, the budget is max(384, 250 n // 8) tokens: 2000 -> 8 prompts, 14000 / 8
    # -> 7, 12250 / 8 -> 6, ...
    expected, left = [], 64
    while left:
        take = min(left, max(1, max(384, 250 * left // 8) // 250))
        expected.append(take)
        left -= take
    assert grown == expected
    assert grown[:3] == [8, 7, 6] and grown[-1] == 1


def test_cpu_prefill_batches_keep_to_the_default_budget() -> None:
    """Six 150-token prompts waiting at once: the CPU default admits two per prefill batch
    (300 <= 384 < 450), where SGLang's 16384 took all six in one."""
    worker = ScriptedWorker(max_total_tokens=8192)
    driver = InProcessDriver(ServerArgs(device="cpu"), worker=worker, tokenizer=None)
    prompts = [[(i * 31 + k) % 900 + 1 for k in range(150)] for i in range(6)]
    outs = driver.generate(prompts, {"max_new_tokens": 3, "ignore_eos": True})
    assert all(len(o["output_ids"]) == 3 for o in outs)
    extends = [b for b in worker.forward_calls if b.forward_mode.is_extend()]
    assert [len(b.seq_lens) for b in extends] == [2, 2, 2]
    assert_idle_and_clean(driver)
