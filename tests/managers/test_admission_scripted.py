"""Admission limits, time limits and priority in the scheduler, driven by the scripted worker
(no model) under both event loops, with a fake clock for the deadlines."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.managers.scripted_worker import (
    ScriptedWorker,
    assert_idle_and_clean,
    first_token_order,
    scripted_output,
)

PROMPT_LEN = 20


@pytest.fixture(params=["overlap", "normal"])
def loop_kind(request) -> str:
    return request.param


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_driver(
    loop_kind: str, max_running_requests: int = 1, max_total_tokens: int = 4096, **args
) -> InProcessDriver:
    server_args = ServerArgs(disable_overlap_schedule=loop_kind == "normal", **args)
    worker = ScriptedWorker(max_total_tokens, max_running_requests)
    return InProcessDriver(server_args, worker=worker, tokenizer=None)


def prompt(i: int) -> list[int]:
    return [(i * 37 + k) % 997 + 1 for k in range(PROMPT_LEN)]


def finish(driver: InProcessDriver, rid: str) -> dict:
    return driver.result(rid)["meta_info"].get("finish_reason")


def steps(driver: InProcessDriver, n: int) -> None:
    for _ in range(n):
        driver.step()


# ---- time limits --------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["request", "server"])
def test_waiting_request_times_out_with_503(loop_kind: str, limit: str) -> None:
    args = {"waiting_timeout": 1.0} if limit == "server" else {}
    driver = make_driver(loop_kind, **args)
    clock = driver.scheduler.deadlines.clock = FakeClock()
    [running] = driver.submit(prompt(0), {"max_new_tokens": 30})
    steps(driver, 3)
    fields = {"timeout": 1.0} if limit == "request" else {}
    [queued] = driver.submit(prompt(1), {"max_new_tokens": 5}, **fields)
    steps(driver, 3)
    assert finish(driver, queued) is None  # the one row is taken: still waiting
    clock.now += 1.01
    driver.step()  # one step after the deadline finishes it
    reason = finish(driver, queued)
    assert reason["type"] == "abort" and reason["status_code"] == 503, reason
    assert "timed out after 1 s" in reason["message"]
    assert "waiting for admission" in reason["message"]
    assert ("--waiting-timeout" in reason["message"]) == (limit == "server")
    assert driver.result(queued)["output_ids"] == []
    driver.run_until_idle()
    assert driver.result(running)["output_ids"] == scripted_output(prompt(0), 30)
    assert finish(driver, running) == {"type": "length", "length": 30}
    assert_idle_and_clean(driver)


@pytest.mark.parametrize("limit", ["request", "server"])
def test_running_request_times_out_with_its_output(loop_kind: str, limit: str) -> None:
    args = {"running_timeout": 2.0} if limit == "server" else {}
    driver = make_driver(loop_kind, max_running_requests=4, **args)
    clock = driver.scheduler.deadlines.clock = FakeClock()
    fields = {"timeout": 2.0} if limit == "request" else {}
    [slow] = driver.submit(prompt(0), {"max_new_tokens": 200}, **fields)
    steps(driver, 10)
    clock.now += 2.5
    [other] = driver.submit(prompt(1), {"max_new_tokens": 40})  # its clocks start now
    driver.run_until_idle()
    reason = finish(driver, slow)
    assert reason["type"] == "abort" and "status_code" not in reason, reason
    assert "timed out after 2 s" in reason["message"]
    assert ("--running-timeout" in reason["message"]) == (limit == "server")
    out = driver.result(slow)["output_ids"]
    assert 0 < len(out) < 200
    assert out == scripted_output(prompt(0), len(out))
    assert driver.result(other)["output_ids"] == scripted_output(prompt(1), 40)
    assert_idle_and_clean(driver)  # the timed-out request's KV went back


def test_waiting_timeout_does_not_apply_after_admission(loop_kind: str) -> None:
    driver = make_driver(loop_kind, waiting_timeout=1.0)
    clock = driver.scheduler.deadlines.clock = FakeClock()
    [rid] = driver.submit(prompt(0), {"max_new_tokens": 20})
    steps(driver, 3)
    clock.now += 5
    driver.run_until_idle()
    assert finish(driver, rid) == {"type": "length", "length": 20}
    assert len(driver.scheduler.deadlines) == 0  # the stale entry was dropped
    assert_idle_and_clean(driver)


def test_every_queued_request_expires_in_one_step(loop_kind: str) -> None:
    driver = make_driver(loop_kind, waiting_timeout=1.0)
    clock = driver.scheduler.deadlines.clock = FakeClock()
    [running] = driver.submit(prompt(0), {"max_new_tokens": 30})
    steps(driver, 2)
    queued = [driver.submit(prompt(i), {"max_new_tokens": 5})[0] for i in range(1, 9)]
    clock.now += 1.01
    driver.step()
    assert all(finish(driver, r)["status_code"] == 503 for r in queued)
    assert not driver.scheduler.queues.waiting
    assert driver.scheduler.intake.num_timed_out_reqs == len(queued)
    driver.run_until_idle()
    assert finish(driver, running)["type"] == "length"
    assert_idle_and_clean(driver)


# ---- queue bounds ---------------------------------------------------------------------
def test_full_queue_refuses_with_503(loop_kind: str) -> None:
    driver = make_driver(loop_kind, max_queued_requests=2)
    rids = [driver.submit(prompt(i), {"max_new_tokens": 8})[0] for i in range(6)]
    # Nothing ran yet: one for the free row and two queued wait, three are refused at once.
    for rid in rids[3:]:
        reason = finish(driver, rid)
        assert reason["status_code"] == 503 and "--max-queued-requests 2" in reason["message"]
    driver.run_until_idle()
    for i, rid in enumerate(rids[:3]):
        assert driver.result(rid)["output_ids"] == scripted_output(prompt(i), 8)
    assert driver.scheduler.intake.num_refused_reqs == 3
    assert_idle_and_clean(driver)


def test_admitted_requests_leave_room_in_the_queue(loop_kind: str) -> None:
    driver = make_driver(loop_kind, max_running_requests=2, max_queued_requests=1)
    first = [driver.submit(prompt(i), {"max_new_tokens": 30})[0] for i in range(2)]
    steps(driver, 2)  # both admitted: no free row, and the queue is empty again
    more = [driver.submit(prompt(i), {"max_new_tokens": 30})[0] for i in range(2, 5)]
    assert finish(driver, more[0]) is None
    assert all(finish(driver, r)["status_code"] == 503 for r in more[1:])
    driver.run_until_idle()
    assert all(finish(driver, r)["type"] == "length" for r in first + more[:1])
    assert_idle_and_clean(driver)


def test_queued_token_bound(loop_kind: str) -> None:
    driver = make_driver(loop_kind, max_queued_tokens=3 * PROMPT_LEN)
    long = driver.submit(prompt(0) * 5, {"max_new_tokens": 4})[0]  # alone: any size queues
    short = driver.submit(prompt(1), {"max_new_tokens": 4})[0]
    assert finish(driver, long) is None
    reason = finish(driver, short)
    assert reason["status_code"] == 503 and "--max-queued-tokens" in reason["message"]
    driver.run_until_idle()
    assert finish(driver, long)["type"] == "length"
    assert_idle_and_clean(driver)


# ---- priority -------------------------------------------------------------------------
@pytest.mark.parametrize("low_first", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_priority_orders_admission(loop_kind: str, low_first: bool, policy: str) -> None:
    driver = make_driver(
        loop_kind,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
        schedule_policy=policy,
    )
    order = first_token_order(driver)
    head = driver.submit(prompt(0), {"max_new_tokens": 4}, rid="head", priority=0)
    driver.step()  # runs alone; the rest queue behind it
    for rid, prio in (("p0", 0), ("p5", 5), ("p1", 1), ("p5b", 5), ("m3", -3)):
        driver.submit(
            prompt(len(order) + sum(map(ord, rid)) % 50),
            {"max_new_tokens": 4},
            rid=rid,
            priority=prio,
        )
    driver.run_until_idle()
    expected = ["p5", "p5b", "p1", "p0", "m3"]  # arrival order within a level
    if low_first:
        expected = ["m3", "p0", "p1", "p5", "p5b"]
    assert order == head + expected
    assert_idle_and_clean(driver)


def test_without_priority_scheduling_arrival_order(loop_kind: str) -> None:
    driver = make_driver(loop_kind, schedule_policy="fcfs")
    order = first_token_order(driver)
    driver.submit(prompt(0), {"max_new_tokens": 4}, rid="head")
    driver.step()
    for i, rid in enumerate(("a", "b", "c")):
        driver.submit(prompt(i + 1), {"max_new_tokens": 4}, rid=rid, priority=10 * i)
    driver.run_until_idle()
    assert order == ["head", "a", "b", "c"]


def test_urgent_newcomer_displaces_least_urgent_waiting(loop_kind: str) -> None:
    driver = make_driver(loop_kind, enable_priority_scheduling=True, max_queued_requests=2)
    driver.submit(prompt(0), {"max_new_tokens": 20}, rid="run")
    driver.step()
    driver.submit(prompt(1), {"max_new_tokens": 4}, rid="low-old", priority=0)
    driver.submit(prompt(2), {"max_new_tokens": 4}, rid="low-new", priority=0)
    driver.submit(prompt(3), {"max_new_tokens": 4}, rid="urgent", priority=5)
    driver.submit(prompt(4), {"max_new_tokens": 4}, rid="low-late", priority=0)
    displaced = finish(driver, "low-new")
    assert displaced["status_code"] == 503 and "higher priority" in displaced["message"]
    assert finish(driver, "low-late")["status_code"] == 503  # not more urgent: refused
    driver.run_until_idle()
    for rid in ("run", "low-old", "urgent"):
        assert finish(driver, rid)["type"] == "length", rid
    assert_idle_and_clean(driver)


def test_running_deadline_of_a_retracted_request(loop_kind: str) -> None:
    """A request retracted back to the queue keeps its admission time: its running limit
    finishes it there (its KV went back at the retraction), and the others complete."""
    driver = make_driver(
        loop_kind,
        max_running_requests=8,
        max_total_tokens=320,
        schedule_conservativeness=0.1,  # admit eagerly: decoding then needs a retraction
        running_timeout=5.0,
    )
    sched = driver.scheduler
    clock = sched.deadlines.clock = FakeClock()
    rids = [driver.submit(prompt(i) * 2, {"max_new_tokens": 40})[0] for i in range(8)]
    retracted: list = []
    while not retracted and driver.step():
        retracted = [r for r in sched.queues.waiting if r.admission.admitted is not None]
    assert retracted, "the pool was meant to force a retraction"
    clock.now += 6
    driver.step()
    for req in retracted:
        reason = finish(driver, req.rid)
        assert reason["type"] == "abort" and "--running-timeout" in reason["message"], reason
        assert "status_code" not in reason
    driver.run_until_idle()
    assert all(finish(driver, rid) is not None for rid in rids)
    assert_idle_and_clean(driver)


class SlowGrammars:
    """A grammar backend whose compiles never finish."""

    def compile_async(self, key) -> Future:
        return Future()

    def new_matcher(self, compiled):  # pragma: no cover - never called
        raise AssertionError


def test_request_waiting_for_its_grammar_times_out(loop_kind: str) -> None:
    driver = make_driver(loop_kind, waiting_timeout=1.0)
    sched = driver.scheduler
    sched.intake.grammar_backend = SlowGrammars()
    clock = sched.deadlines.clock = FakeClock()
    [rid] = driver.submit(prompt(0), {"max_new_tokens": 4, "regex": "[0-9]+"})
    steps(driver, 2)
    assert len(sched.intake.grammar_queue) == 1 and finish(driver, rid) is None
    clock.now += 1.01
    driver.step()
    reason = finish(driver, rid)
    assert reason["status_code"] == 503 and "waiting for admission" in reason["message"]
    assert not sched.intake.grammar_queue
    assert_idle_and_clean(driver)


def test_deadline_heap_drops_finished_requests() -> None:
    from managers.io_struct import finish_length
    from managers.req import Req
    from managers.scheduler.deadlines import MIN_COMPACT_LEN, Deadlines
    from srt.sampling.sampling_params import SamplingParams

    deadlines = Deadlines(waiting_timeout=60.0, running_timeout=None, clock=FakeClock())
    reqs = [Req(f"r{i}", [1], SamplingParams(), sampling_seed=0) for i in range(3000)]
    for req in reqs:
        deadlines.arrived(req)
        req.finished_reason = finish_length(1)  # finished long before its deadline
    assert len(deadlines) <= MIN_COMPACT_LEN + 1
    assert deadlines.expired() == []
