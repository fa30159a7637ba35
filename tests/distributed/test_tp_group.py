"""TPGroup collectives over gloo between real processes: values, both groups used from two
threads at once (the overlap loop's shape), a lost peer and a group that never forms."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading
import time

import torch

from srt.distributed import TPGroup, TPInitError, TPSpec, init_tp_group
from tests.distributed.tp_harness import TPRanks


def _collectives(tp: TPGroup) -> dict:
    x = torch.full((3, 4), float(tp.rank + 1), dtype=torch.bfloat16)
    tp.all_reduce(x)
    gathered = tp.all_gather_last_dim(torch.full((2, 2), float(tp.rank)))
    ids = torch.tensor([7, 8]) if tp.is_leader else torch.zeros(2, dtype=torch.int64)
    tp.broadcast_tensor(ids)
    obj = tp.broadcast_object({"step": 1} if tp.is_leader else None)
    return {
        "sum": x.float().unique().tolist(),
        "gathered": gathered[0].tolist(),
        "ids": ids.tolist(),
        "obj": obj,
        "min": tp.agree_min(100 - tp.rank),
        "all": tp.gather_objects(tp.rank * 10),
    }


def test_collective_values(tp2: TPRanks) -> None:
    r0, r1 = tp2.run(_collectives)
    for r in (r0, r1):
        assert r["sum"] == [3.0] and r["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert r["ids"] == [7, 8] and r["obj"] == {"step": 1} and r["min"] == 99
    assert r0["all"] == [0, 10] and r1["all"] is None


def _two_threads(tp: TPGroup, seconds: float) -> tuple[int, int]:
    """The forward thread all-reduces while the scheduler thread broadcasts; a mix-up of the
    two groups would hang or corrupt values."""
    counts = [0, 0]
    n = 200

    def model() -> None:
        for i in range(n):
            x = torch.full((8,), float(i + tp.rank))
            tp.all_reduce(x)
            assert x[0].item() == 2 * i + 1
            counts[0] += 1

    def control() -> None:
        for i in range(n):
            assert tp.broadcast_object(i if tp.is_leader else None) == i
            counts[1] += 1

    threads = [threading.Thread(target=model), threading.Thread(target=control)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
    return counts[0], counts[1]


def test_model_and_control_groups_from_two_threads(tp2: TPRanks) -> None:
    assert tp2.run(_two_threads, 60.0) == [(200, 200), (200, 200)]


def _wait_for_broadcast(tp: TPGroup) -> str:
    t0 = time.monotonic()
    try:
        tp.broadcast_object("x" if tp.is_leader else None)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"


def _exit_at_once(tp: TPGroup) -> None:
    import os

    os._exit(9)


def test_lost_peer_raises_tp_peer_lost() -> None:
    ranks = TPRanks(2)
    try:
        ranks._conns[0].send((_wait_for_broadcast, (), {}))
        ranks._conns[1].send((_exit_at_once, (), {}))
        msg = ranks._recv(0)
        assert msg.startswith("TPPeerLost") and "TP rank 0: broadcast_object failed" in msg
        assert float(msg.split(" after ")[1].split("s:")[0]) < 10
    finally:
        ranks.close()


def _join(spec: TPSpec, out: mp.Queue) -> None:
    try:
        init_tp_group(spec)
        out.put("joined")
    except TPInitError as e:
        out.put(str(e))


def test_group_that_never_forms_fails_with_a_clear_error() -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = TPSpec(0, 2, 0, 1, f"file://{d}/store", "gloo", init_timeout_s=2.0)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_join, args=(spec, out))
        proc.start()
        msg = out.get(timeout=60)
        proc.join(10)
    assert "did not form within 2 s" in msg and "--dist-init-addr" in msg


def test_single_group_is_the_identity() -> None:
    tp = TPGroup.single()
    x = torch.ones(2)
    assert tp.all_reduce(x) is x and tp.all_gather_last_dim(x) is x
    assert tp.broadcast_object("a") == "a" and tp.gather_objects(1) == [1]
    assert tp.agree_min(5) == 5 and tp.is_leader
