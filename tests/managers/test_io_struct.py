"""The typed records that cross process boundaries: they pickle (ZMQ `send_pyobj`), a request
without logprobs carries none, and the JSON edge keeps SGLang's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

from managers.detokenizer_manager import DetokenizerManager
from managers.inprocess import InProcessDriver
from managers.io_struct import (
    BatchTokenIDOut,
    DecodeOptions,
    GetInternalStateReqOutput,
    LogprobDelta,
    MemoryIntegrity,
    ReqOutput,
    SchedulerState,
    finish_abort,
    finish_length,
    finish_matched,
)
from managers.req_state import ReqState
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from tests.managers.scripted_worker import ScriptedWorker


def sample_batch() -> BatchTokenIDOut:
    opts = DecodeOptions(stop=("</s>",), no_stop_trim=True)
    with_lp = ReqOutput(
        "a", [5, 6], finish_matched("</s>"), 3, 2, 1, opts,
        LogprobDelta([(-0.5, 5), (-0.25, 6)], [[(-0.5, 5)], [(-0.25, 6)]],
                     [(None, 1), (-1.0, 2)], [None, [(-1.0, 2)]]),
    )  # fmt: skip
    without = ReqOutput("b", [7], None, 4, 1, 0, DecodeOptions())
    aborted = ReqOutput("c", [], finish_abort("bad grammar", 400), 2, 0, 0, DecodeOptions())
    return BatchTokenIDOut([with_lp, without, aborted])


def test_batch_token_id_out_pickles() -> None:
    batch = sample_batch()
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch
    assert back.outputs[1].logprobs is None
    assert back.outputs[2].finish_reason is not None and back.outputs[2].finish_reason.is_abort
    strs = DetokenizerManager(tokenizer=None).handle(back)
    assert pickle.loads(pickle.dumps(strs)) == strs
    assert [o.output.rid for o in strs.outputs] == ["a", "b", "c"]


def test_scheduler_output_has_logprobs_only_when_asked() -> None:
    driver = InProcessDriver(ServerArgs(), worker=ScriptedWorker(), tokenizer=None)
    batches: list[BatchTokenIDOut] = []
    sink = driver.scheduler.emitter.sink
    driver.scheduler.emitter.sink = lambda b: (batches.append(b), sink(b))
    params = SamplingParams(max_new_tokens=4, temperature=0)
    plain = driver.submit([1, 2, 3, 4], params, stream=True)[0]
    with_lp = driver.submit([5, 6, 7], params, stream=True, return_logprob=True)[0]
    driver.run_until_idle()
    outs = [pickle.loads(pickle.dumps(o)) for b in batches for o in b.outputs]
    assert {o.rid for o in outs} == {plain, with_lp}
    assert all(o.logprobs is None for o in outs if o.rid == plain)
    assert all(isinstance(o.logprobs, LogprobDelta) for o in outs if o.rid == with_lp)
    ids = [t for o in outs if o.rid == plain for t in o.new_token_ids]
    assert ids == driver.result(plain)["output_ids"] and len(ids) == 4
    assert [o.finish_reason for o in outs if o.rid == plain][-1] == finish_length(4)
    assert "output_token_logprobs" not in driver.result(plain)["meta_info"]


def test_req_state_meta_keeps_the_json_shapes() -> None:
    async def run() -> dict:
        ready: asyncio.Queue[ReqState] = asyncio.Queue()
        state = ReqState("b", "b", 0, ready, stream=False, return_logprob=True)
        out = ReqOutput("b", [7], finish_matched(7), 4, 1, 0, DecodeOptions())  # no logprobs
        state.apply(out, "x", lambda t: None)
        return state.snapshot()

    snap = asyncio.run(run())
    meta = snap["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 7}
    assert meta["output_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert snap["text"] == "x" and snap["output_ids"] == [7]
    assert finish_length(9).to_json() == {"type": "length", "length": 9}
    assert finish_abort("m").to_json() == {"type": "abort", "message": "m"}
    assert finish_abort("m", 503).to_json() == {"type": "abort", "message": "m", "status_code": 503}


def test_scheduler_state_is_the_server_info_json() -> None:
    state = SchedulerState(
        num_running_reqs=0, num_queue_reqs=0, token_usage=0.0, max_total_tokens=8,
        max_running_requests=2, num_retracted_reqs=0, num_aborted_reqs=0,
        overlap_schedule=True, worker_idle_s=0.0, worker_busy_s=0.0, pid=1,
        new_token_ratio=0.5, forward_ct=3, memory_integrity=MemoryIntegrity(True, None, 1.0),
    )  # fmt: skip
    msg = pickle.loads(pickle.dumps(GetInternalStateReqOutput(state)))
    info = dataclasses.asdict(msg.state)
    assert info["memory_integrity"] == {"ok": True, "error": None, "time": 1.0}
    assert list(info)[:2] == ["num_running_reqs", "num_queue_reqs"] and info["forward_ct"] == 3
