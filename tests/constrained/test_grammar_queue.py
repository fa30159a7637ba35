"""`GrammarQueue` alone, with hand-made futures: no model, no compiler."""

from __future__ import annotations

import time
from concurrent.futures import Future

from constrained.base_grammar_backend import GrammarError
from managers.req import Req
from managers.scheduler.grammar_queue import GrammarQueue
from srt.sampling.sampling_params import SamplingParams


def make_req(rid: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(), sampling_seed=0)


def resolved(value: object = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
    return future


def test_never_completing_compile_times_out_with_400() -> None:
    queue = GrammarQueue(timeout_s=0.01)
    req = make_req("slow")
    queue.add(req, Future())  # never completes

    ready, failed = queue.pop_done(lambda compiled: compiled, block=False)
    assert (ready, failed) == ([], []) and len(queue) == 1, "timed out before its deadline"
    assert req.finished_reason is None

    time.sleep(0.02)
    ready, failed = queue.pop_done(lambda compiled: compiled, block=True)
    assert ready == [] and failed == [req]
    assert not queue
    assert req.grammar is None
    assert req.finished_reason.to_json() == {
        "type": "abort",
        "message": "Grammar compilation did not finish within 0.01 s.",
        "status_code": 400,
    }


def test_blocking_pop_waits_briefly_instead_of_spinning() -> None:
    queue = GrammarQueue(timeout_s=60)
    queue.add(make_req("pending"), Future())
    tic = time.perf_counter()
    assert queue.pop_done(lambda c: c, block=True) == ([], [])
    assert time.perf_counter() - tic < 1.0
    assert len(queue) == 1


def test_ready_invalid_and_failed_compiles_leave_the_queue() -> None:
    queue = GrammarQueue(timeout_s=60)
    ok, bad, broken, pending = (make_req(r) for r in ("ok", "bad", "broken", "pending"))
    queue.add(ok, resolved("compiled"))
    queue.add(bad, resolved(error=GrammarError("Regex parsing error")))
    queue.add(broken, resolved(error=KeyError("boom")))
    queue.add(pending, Future())

    ready, failed = queue.pop_done(lambda compiled: f"matcher of {compiled}", block=False)

    assert ready == [ok] and ok.grammar == "matcher of compiled" and ok.finished_reason is None
    assert failed == [bad, broken]
    assert bad.finished_reason.to_json() == {
        "type": "abort",
        "message": "Invalid grammar: Regex parsing error",
        "status_code": 400,
    }
    assert broken.finished_reason.message.startswith("Grammar compilation failed: ")
    assert broken.finished_reason.status_code == 400
    assert [e.req for e in queue.entries] == [pending]


def test_remove_if_takes_only_matching_requests() -> None:
    queue = GrammarQueue(timeout_s=60)
    a, b = make_req("a"), make_req("b")
    queue.add(a, Future())
    queue.add(b, Future())
    assert queue.remove_if(lambda r: r.rid == "a") == [a]
    assert [e.req for e in queue.entries] == [b]
