"""Which event loop the scheduler runs: by default the normal loop on CPU (the forward's threads
already take every core, so the overlap loop's scheduler thread only slows them) and the
overlap loop on GPU; `--disable-overlap-schedule` and `--enable-overlap-schedule` choose."""

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
