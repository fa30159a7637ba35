"""PD cleanup without races: a decode-side abort or timeout cancels the room on the prefill
side, and the slots it announced stay quarantined until the prefill side acknowledges (or a
time bound passes), so a late KV write never lands in another request's KV.

Both schedulers run in this process with a tiny random model; a gate on the prefill side's
transfer backend holds its write past the decode side's timeout."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

from disagg.base import KVArgs
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.tiny_models import VOCAB, save_tiny_model
from tests.ports import free_port

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT_LEN = 200
# Room for one prompt's preallocation (A) but not for a second prompt (B) beside it: B can
# only run on A's slots, so it would get them at once if A's timeout freed them.
TIGHT_POOL = 320


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 1) for _ in range(n)]


def server(model_path: str, mode: str = "null", **args) -> InProcessDriver:
    args.setdefault("max_total_tokens", 8192)
    return InProcessDriver(
        ServerArgs(
            model_path=model_path,
            dtype="float32",
            skip_tokenizer_init=True,
            disaggregation_mode=mode,
            **args,
        )
    )


def pd_pair(
    model_path: str,
    backend: str,
    decode_args: dict,
    prefill: bool = True,
    prefill_args: dict | None = None,
) -> tuple[InProcessDriver | None, InProcessDriver, int]:
    module = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}.get(backend)
    if module is not None:
        pytest.importorskip(module, reason=f"{backend} is not installed")
    port = free_port()
    common = {"disaggregation_transfer_backend": backend, "disaggregation_bootstrap_port": port}
    p = server(model_path, "prefill", **common, **(prefill_args or {})) if prefill else None
    d = server(model_path, "decode", **common, **decode_args)
    return p, d, port


def step_until(cond: Callable[[], bool], *drivers: InProcessDriver, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out stepping the servers"
        ran = [d.step() for d in drivers]
        if not any(ran):
            time.sleep(0.002)


def step_for(seconds: float, *drivers: InProcessDriver) -> None:
    end = time.monotonic() + seconds
    step_until(lambda: time.monotonic() > end, *drivers, timeout=seconds + 10)


def finish_reason(driver: InProcessDriver, rid: str) -> dict | None:
    return driver.result(rid)["meta_info"].get("finish_reason")


def kv_at(driver: InProcessDriver, slots: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's K and V at `slots` (a copy)."""
    kv = KVArgs.from_pool(driver.worker.model_runner.token_to_kv_pool)
    idx = slots.to(torch.int64)
    return [buf[idx].clone() for buf in kv.buffers()]


def cached_kv(driver: InProcessDriver, ids: list[int]) -> list[torch.Tensor]:
    """The KV the server's radix tree holds for `ids` (all of them must be cached)."""
    match = driver.scheduler.kv.match_prefix(ids, None)
    assert match.prefix_len == len(ids)
    return kv_at(driver, match.device_indices)


def assert_clean(*drivers: InProcessDriver) -> None:
    for d in drivers:
        assert d.scheduler.is_idle()
        d.scheduler.check_memory()
        assert d.scheduler.kv.quarantined_tokens() == 0
        assert d.scheduler.kv.token_usage() == 0


class GatedWrite:
    """Wraps a transfer backend's `write`: it starts, then waits for `gate` before writing."""

    def __init__(self, write: Callable) -> None:
        self.write = write
        self.started = threading.Event()
        self.gate = threading.Event()
        self.landed = threading.Event()

    def __call__(self, peer, src_slots, dst_slots) -> None:
        self.started.set()
        assert self.gate.wait(60)
        self.write(peer, src_slots, dst_slots)
        self.landed.set()


@pytest.mark.parametrize("backend", ["loopback", "mooncake", "nixl"])
def test_late_write_after_decode_timeout_changes_no_other_kv(
    model_path: str, backend: str, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="disagg")
    prefill, decode, port = pd_pair(
        model_path,
        backend,
        {
            "max_total_tokens": TIGHT_POOL,
            "disaggregation_timeout": 1.0,
            "disaggregation_quarantine_timeout": 60.0,  # so only the acknowledgement releases
        },
    )
    assert prefill is not None
    gated = prefill.scheduler.disagg.transfer.write = GatedWrite(
        prefill.scheduler.disagg.transfer.write
    )
    a, b = prompt(1), prompt(2)
    params = {"max_new_tokens": 8, **GREEDY}
    room = 4242

    # A: the prefill side computes it and starts its write, which the gate holds past the
    # decode side's 1 s timeout.
    [pa] = prefill.submit(a, dict(params), bootstrap=("127.0.0.1", port, room))
    [da] = decode.submit(a, dict(params), bootstrap=("127.0.0.1", port, room))
    step_until(gated.started.is_set, prefill, decode)
    step_until(lambda: finish_reason(decode, da) is not None, prefill, decode)
    reason = finish_reason(decode, da)
    assert reason["type"] == "abort" and "timed out" in reason["message"]
    kv = decode.scheduler.kv
    assert kv.quarantined_tokens() == PROMPT_LEN
    a_slots = kv.quarantined[room].clone()
    decode.scheduler.check_memory()  # quarantined slots are owned: integrity holds

    # B, an ordinary request on the decode server, needs A's slots: it waits while they are
    # quarantined (the prefill side got the cancel but its write is still running).
    [db] = decode.submit(b, dict(params))
    step_for(0.5, prefill, decode)
    assert any(r.rid == db for r in decode.scheduler.queues.waiting)
    assert kv.quarantined_tokens() == PROMPT_LEN
    assert finish_reason(prefill, pa) is None  # its write is not over

    # The late write lands (the decode server steps on meanwhile, as a live one does: a
    # library without its own progress thread moves inbound writes on in its step); only
    # then does the prefill side acknowledge.
    gated.gate.set()
    step_until(gated.landed.is_set, decode)
    landed = kv_at(decode, a_slots)
    assert room in kv.quarantined  # still held until the acknowledgement arrives
    step_until(lambda: finish_reason(decode, db) is not None, prefill, decode)
    assert not kv.quarantined
    step_until(lambda: decode.scheduler.is_idle() and prefill.scheduler.is_idle(), prefill, decode)

    # The prefill side dropped the room: its request finished as cancelled, its KV cached.
    reason = finish_reason(prefill, pa)
    assert reason["type"] == "abort" and "cancelled by the decode server" in reason["message"]
    if backend != "loopback":  # a one-sided write: it really landed in A's old slots
        assert all(torch.equal(x, y) for x, y in zip(landed, cached_kv(prefill, a), strict=True))

    # B is untouched: its output and its cached KV equal a run on a fresh server.
    reference = server(model_path)
    [ref] = reference.generate([b], params)
    assert decode.result(db)["output_ids"] == ref["output_ids"]
    assert finish_reason(decode, db)["type"] == "length"
    for got, want in zip(cached_kv(decode, b), cached_kv(reference, b), strict=True):
        assert torch.equal(got, want)
    assert not [r for r in caplog.records if "KV quarantine timed out" in r.getMessage()]
    assert_clean(prefill, decode)


def test_quarantine_bound_releases_unacknowledged_slots_with_a_warning(
    model_path: str, caplog
) -> None:
    """No prefill server answers at all: the slots are released by the time bound."""
    _, decode, port = pd_pair(
        model_path,
        "loopback",
        {"disaggregation_timeout": 0.3, "disaggregation_quarantine_timeout": 0.5},
        prefill=False,
    )
    [rid] = decode.submit(prompt(3), {"max_new_tokens": 4}, bootstrap=("127.0.0.1", port, 9))
    step_until(lambda: finish_reason(decode, rid) is not None, decode)
    assert "timed out" in finish_reason(decode, rid)["message"]
    kv = decode.scheduler.kv
    assert kv.quarantined_tokens() == PROMPT_LEN and kv.token_usage() > 0
    decode.scheduler.check_memory()
    tic = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="disagg"):
        step_until(lambda: not kv.quarantined, decode)
    assert time.monotonic() - tic > 0.2  # not before the bound
    assert any("did not acknowledge" in r.getMessage() for r in caplog.records)
    assert_clean(decode)


def test_decode_abort_before_the_prefill_request_arrives(model_path: str) -> None:
    """Decode registers and is aborted before the prefill side saw the request: the prefill
    side drops the registration, acknowledges, and refuses the request when it arrives."""
    prefill, decode, port = pd_pair(model_path, "loopback", {"disaggregation_timeout": 30.0})
    assert prefill is not None
    ids, boot = prompt(4), ("127.0.0.1", port, 77)
    [drid] = decode.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    decode.step()  # preallocated and registered
    decode.abort(drid)
    assert decode.scheduler.kv.quarantined_tokens() == PROMPT_LEN
    step_until(lambda: not decode.scheduler.kv.quarantined, prefill, decode)  # acknowledged
    [prid] = prefill.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    step_until(lambda: finish_reason(prefill, prid) is not None, prefill, decode, timeout=5)
    assert "cancelled by the decode server" in finish_reason(prefill, prid)["message"]
    assert finish_reason(decode, drid)["type"] == "abort"
    assert_clean(prefill, decode)


def test_decode_abort_during_the_prefill_forward(model_path: str) -> None:
    """The cancel reaches the prefill side while its forward runs (overlap loop): the request
    finishes there as aborted, nothing is written, and both sides' KV is accounted for."""
    prefill, decode, port = pd_pair(
        model_path,
        "loopback",
        {"disaggregation_timeout": 30.0},
        prefill_args={"disable_overlap_schedule": False},  # the overlap loop, also on CPU
    )
    assert prefill is not None
    writes: list[int] = []
    prefill.scheduler.disagg.transfer.write = lambda peer, src, dst: writes.append(len(dst))
    ids, boot = prompt(5), ("127.0.0.1", port, 78)
    [prid] = prefill.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    [drid] = decode.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    decode.step()  # registered
    p = prefill.scheduler
    step_until(lambda: p.pending is not None, prefill)  # the forward is launched, not processed
    assert p.disagg.claimed
    decode.abort(drid)
    assert p.disagg.server.sock.poll(5000)  # the cancel is there before the result is processed
    step_until(lambda: not decode.scheduler.kv.quarantined, prefill, decode)
    step_until(lambda: p.is_idle(), prefill, decode)
    assert "cancelled by the decode server" in finish_reason(prefill, prid)["message"]
    assert writes == [] and not p.disagg.claimed and not p.disagg.inflight
    assert_clean(prefill, decode)


def test_prefill_side_abort_lets_decode_free_at_once(model_path: str) -> None:
    """The prefill side's own client aborts: decode hears a failure and frees its slots
    without quarantine (nothing will be written)."""
    prefill, decode, port = pd_pair(model_path, "loopback", {"disaggregation_timeout": 30.0})
    assert prefill is not None
    ids, boot = prompt(6), ("127.0.0.1", port, 79)
    [prid] = prefill.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    [drid] = decode.submit(ids, {"max_new_tokens": 4}, bootstrap=boot)
    decode.step()
    prefill.abort(prid)  # still in its bootstrap queue
    step_until(lambda: finish_reason(decode, drid) is not None, prefill, decode, timeout=5)
    assert "request aborted" in finish_reason(decode, drid)["message"]
    assert not decode.scheduler.kv.quarantined
    step_until(lambda: prefill.scheduler.is_idle() and decode.scheduler.is_idle(), prefill, decode)
    assert_clean(prefill, decode)
