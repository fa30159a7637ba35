"""Scheduler defaults that depend on the device.

- The event loop: by default the normal loop on CPU (the forward's threads already take every
  core, so the overlap loop's scheduler thread only slows them) and the overlap loop on GPU;
  `--disable-overlap-schedule` and `--enable-overlap-schedule` choose.
- The prefill-token budget of one batch: 384 on CPU (prefill throughput is nearly flat beyond
  a few hundred tokens), SGLang's 16384 on GPU; `--max-prefill-tokens` sets it."""

from __future__ import annotations

import pytest

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs, prepare_server_args
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


def test_cpu_prefill_batches_keep_to_the_default_budget() -> None:
    """Six 150-token prompts waiting at once: the CPU default admits two per prefill batch
    (300 <= 384 < 450), where SGLang's 16384 took all six in one."""
    worker = ScriptedWorker(max_total_tokens=8192)
    driver = InProcessDriver(ServerArgs(device="cpu"), worker=worker, tokenizer=None)
    prompts = [[(i * 31 + k) % 900 + 1 for k in range(150)] for i in range(6)]
    outs = driver.generate(prompts, {"max_new_tokens": 3, "ignore_eos": True})
    assert all(len(o["output_ids"]) == 3 for o in outs)
    extends = [b for b in worker.forward_calls if b.forward_mode.is_extend()]
    assert [len(b.seq_lens_cpu) for b in extends] == [2, 2, 2]
    assert_idle_and_clean(driver)
