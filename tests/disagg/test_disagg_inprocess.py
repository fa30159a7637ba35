"""Prefill/decode disaggregation with both schedulers in this process (no HTTP): outputs equal
an aggregated run, for the loopback and mooncake backends and both event loops; failures
finish requests with errors and free every slot on both sides. A tiny random model with the
default tokenizer: the KV's path is checked, for which a real model's weights add nothing
but load time (the PD router tests run the default model)."""

from __future__ import annotations

import time

import pytest

from disagg.base import KVPoll, slot_runs
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from tests.engine.draft_oracles import OracleProposer
from tests.ports import free_port

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Photosynthesis is the process by which plants",
]
PARAMS = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def model(tiny_served_model: str) -> str:
    return tiny_served_model


def pair(
    model: str, backend: str, overlap: bool = True, **extra
) -> tuple[InProcessDriver, InProcessDriver, int]:
    port = free_port()
    common = dict(
        model_path=model,
        dtype="float32",
        max_total_tokens=8192,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=port,
        disable_overlap_schedule=not overlap,
        **extra,
    )
    prefill = InProcessDriver(ServerArgs(disaggregation_mode="prefill", **common))
    decode = InProcessDriver(ServerArgs(disaggregation_mode="decode", **common))
    return prefill, decode, port


def run_pair(prefill, decode, port, texts, params=PARAMS, send_to_prefill=True, rooms=None):
    rids = []
    for i, text in enumerate(texts):
        boot = ("127.0.0.1", port, (rooms or {}).get(i, 5000 + i))
        if send_to_prefill:
            prefill.submit(None, dict(params), text=text, bootstrap=boot)
        rids += decode.submit(None, dict(params), text=text, bootstrap=boot)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if prefill is not None:
            prefill.step()
        decode.step()
        if decode.scheduler.is_idle() and (prefill is None or prefill.scheduler.is_idle()):
            break
    return [decode.result(r) for r in rids]


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    agg = InProcessDriver(ServerArgs(model_path=model, dtype="float32", max_total_tokens=8192))
    return [o["output_ids"] for o in agg.generate(TEXTS, PARAMS)]


@pytest.mark.parametrize(
    ("backend", "overlap"), [("loopback", True), ("loopback", False), ("mooncake", True)]
)
def test_disaggregated_equals_aggregated(
    model: str, reference, backend: str, overlap: bool
) -> None:
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda")
    prefill, decode, port = pair(model, backend, overlap)
    outs = run_pair(prefill, decode, port, TEXTS)
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    for d in (prefill, decode):
        d.scheduler.check_memory()
        assert d.scheduler.kv.token_usage() == 0
    # The prefill side keeps the prompts in its own radix cache: a repeat hits it.
    again = run_pair(prefill, decode, port, TEXTS[:1], rooms={0: 9999})
    assert again[0]["output_ids"] == reference[0]


def test_speculation_on_the_decode_side_equals_aggregated(model: str, reference) -> None:
    """Drafts are verified on the decode server, right from the KV the prefill sent."""
    prefill, decode, port = pair(model, "loopback", overlap=False, speculative_algorithm="ngram")
    # A random model's text gives prompt lookup little to draft: the drafts come from the
    # known outputs instead (every third token wrong).
    known = [decode.tokenizer.encode(t) + ref for t, ref in zip(TEXTS, reference, strict=True)]
    decode.scheduler.drafts.proposer = OracleProposer(known, decode.scheduler.vocab_size)
    outs = run_pair(prefill, decode, port, TEXTS)
    assert [o["output_ids"] for o in outs] == reference
    assert 0 < decode.scheduler.output.spec.accepted < decode.scheduler.output.spec.drafted
    for d in (prefill, decode):
        d.scheduler.check_memory()
        assert d.scheduler.kv.token_usage() == 0


def test_disaggregated_on_the_gpu_path_equals_aggregated(
    model: str, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides on the GPU path, run on this CPU through the device-memory test double: the
    decode side's preallocated rows reach its device table through the logged rewrites, the
    prefill side reads the slots it sends from its host mirror."""
    from tests.managers.device_double import SeparateMemoryDouble

    SeparateMemoryDouble().install(monkeypatch)
    prefill, decode, port = pair(model, "loopback", overlap=True)
    assert decode.worker.model_runner.req_to_token_pool.mirrored
    assert decode.scheduler.forward_worker.threaded is False
    outs = run_pair(prefill, decode, port, TEXTS)
    assert [o["output_ids"] for o in outs] == reference
    for d in (prefill, decode):
        d.scheduler.check_memory()
        assert d.scheduler.kv.token_usage() == 0


def test_missing_prefill_times_out_and_frees(model: str, reference) -> None:
    """No prefill server answers: the decode side gives up after the timeout, quarantines the
    pre-allocated slots until the quarantine bound (nobody acknowledges), frees them, and then
    serves ordinary (aggregated) requests."""
    _, decode, port = pair(
        model, "loopback", disaggregation_timeout=1.0, disaggregation_quarantine_timeout=1.0
    )
    tic = time.monotonic()
    outs = run_pair(None, decode, port, TEXTS[:2], send_to_prefill=False)
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "timed out" in reason["message"]
    assert decode.scheduler.kv.quarantined_tokens() > 0
    decode.scheduler.check_memory()
    while decode.scheduler.kv.quarantined:
        decode.step()
    assert time.monotonic() - tic < 10
    decode.scheduler.check_memory()
    assert decode.scheduler.kv.token_usage() == 0
    assert decode.generate(TEXTS[:1], PARAMS)[0]["output_ids"] == reference[0]


def test_prefill_without_decode_times_out(model: str) -> None:
    prefill, _, _ = pair(model, "loopback", disaggregation_timeout=0.5)
    [rid] = prefill.submit(None, dict(PARAMS), text=TEXTS[0], bootstrap=("127.0.0.1", 1, 7))
    prefill.run_until_idle()
    reason = prefill.result(rid)["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "no decode server" in reason["message"]
    prefill.scheduler.check_memory()


def test_abort_while_waiting_for_kv_frees_slots(model: str) -> None:
    """The slots were announced to the prefill server: they stay quarantined until it
    acknowledges the cancel, then are free (tests/disagg/test_pd_cancel.py has the races)."""
    prefill, decode, port = pair(model, "loopback", disaggregation_timeout=30.0)
    [rid] = decode.submit(None, dict(PARAMS), text=TEXTS[3], bootstrap=("127.0.0.1", port, 42))
    decode.step()
    assert decode.scheduler.disagg.transfer_queue  # slots held, waiting for the prefill side
    assert not decode.scheduler.flush_cache()  # the prefill side may be writing those slots
    decode.abort(rid)
    decode.run_until_idle()
    assert decode.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    assert decode.scheduler.kv.quarantined_tokens() > 0
    decode.scheduler.check_memory()
    deadline = time.monotonic() + 10
    while decode.scheduler.kv.quarantined and time.monotonic() < deadline:
        prefill.step()
        decode.step()
    decode.scheduler.check_memory()
    assert decode.scheduler.kv.allocator.available_size() == decode.scheduler.kv.total_tokens


def test_kvpoll_states_and_slot_runs() -> None:
    assert [s.name for s in sorted(KVPoll)] == [
        "Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success",
    ]  # fmt: skip
    assert slot_runs([5, 6, 7, 20, 21], [100, 101, 102, 8, 9]) == [(5, 100, 3), (20, 8, 2)]
    assert slot_runs([1, 2, 3], [10, 12, 13]) == [(1, 10, 1), (2, 12, 2)]
