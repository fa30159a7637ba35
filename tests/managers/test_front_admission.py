"""The main process's admission check (`managers/admission.py`): it refuses only what is
surely over `--max-queued-requests`, counting requests still being tokenized and what was
sent or ended since the scheduler's latest stats."""

from __future__ import annotations

from managers.admission import FrontAdmission
from managers.errors import RequestError
from managers.io_struct import SchedulerStats


def stats(backlog: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=0, num_queue_reqs=0, token_usage=0.0, cache_hit_rate=0.0,
        gen_throughput=0.0, num_retracted_reqs=0, max_total_tokens=1000,
        num_backlog_reqs=backlog,
    )  # fmt: skip


def refused(adm: FrontAdmission, unfinished: int) -> bool:
    try:
        with adm.arrival(unfinished):
            pass
    except RequestError as e:
        assert e.status_code == 503 and "--max-queued-requests 4" in e.message
        return True
    return False


def test_no_bound_admits_everything() -> None:
    adm = FrontAdmission(None, max_running=2)
    assert not refused(adm, 1000)


def test_unfinished_beyond_the_running_rows_surely_wait() -> None:
    adm = FrontAdmission(4, max_running=2)
    assert not refused(adm, 5)  # 3 surely waiting
    assert refused(adm, 6)


def test_requests_being_tokenized_count() -> None:
    """A burst: all pass the check before any is tokenized and sent."""
    adm = FrontAdmission(4, max_running=2)
    arrivals = [adm.arrival(0) for _ in range(6)]
    for a in arrivals:
        a.__enter__()
    assert refused(adm, 0)
    arrivals[0].__exit__(None, None, None)  # one failed before it was sent
    assert not refused(adm, 0)
    for a in arrivals[1:]:
        a.__exit__(None, None, None)
    assert adm.admitting == 0


def test_sent_moves_a_request_from_arriving_to_sent() -> None:
    adm = FrontAdmission(4, max_running=2)
    adm.on_stats(stats(-2))  # idle: two free rows
    for _ in range(6):
        with adm.arrival(0) as arrival:
            arrival.sent(1)
    assert adm.admitting == 0 and adm.sent_since == 6
    assert refused(adm, 0)  # -2 + 6 sent since the stats
    adm.on_ended(1)
    assert not refused(adm, 0)


def test_the_published_backlog_refuses_what_the_rows_do_not_show() -> None:
    """A queue bound by KV memory: few requests run, the scheduler says 3 wait beyond its
    free rows; one more sent since fills the bound."""
    adm = FrontAdmission(4, max_running=64)
    adm.on_stats(stats(3))
    assert not refused(adm, 4)
    with adm.arrival(4) as arrival:
        arrival.sent(1)
    assert refused(adm, 5)
    adm.on_stats(stats(0))  # fresh stats replace the estimate
    assert not refused(adm, 5)
