"""The real `TokenizerManager`'s receive path against a scheduler stand-in on its ZMQ
sockets: every message waiting is read before the streams are woken, so a stream that fell
behind the scheduler gets one event carrying all its new tokens, not one event per token."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from managers.io_struct import (
    BatchStrOut,
    DecodeOptions,
    GenerateReqInput,
    ReqOutput,
    ReqStrOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
    finish_length,
)
from managers.tokenizer_manager import DRAIN_BATCH, TokenizerManager
from srt.server_args import ServerArgs
from srt.utils.process import PortArgs, zmq_socket

STEPS = 3 * DRAIN_BATCH + 5  # more than one reader callback takes


def stand_in_step(rid: str, step: int) -> BatchStrOut:
    """What the detokenizer sends for one decode step of `rid` (a test double)."""
    finish = finish_length(STEPS) if step == STEPS else None
    out = ReqOutput(rid, [100 + step], finish, 3, step, 0, DecodeOptions())
    return BatchStrOut([ReqStrOutput(out, f" t{step}")])


def test_a_stream_behind_the_scheduler_catches_up_in_few_events(default_model_path: str) -> None:
    port_args = PortArgs.new()
    args = ServerArgs(model_path=default_model_path, device="cpu", skip_tokenizer_init=True)
    ready = SchedulerReady(default_model_path, 4096, 49152, 1 << 16, 64, [], "cpu")
    tm = TokenizerManager(args, port_args, ready, "stand-in")
    ctx = zmq.Context()
    inbox = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc, bind=True)
    outbox = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)

    async def run() -> list[dict[str, Any]]:
        obj = GenerateReqInput(input_ids=[1, 2, 3], stream=True)
        obj.sampling_params = {"max_new_tokens": STEPS, "ignore_eos": True}
        events = tm.generate_request(obj)
        first = asyncio.ensure_future(anext(events))
        while not inbox.poll(0):
            await asyncio.sleep(0.01)
        req = inbox.recv_pyobj()
        assert isinstance(req, TokenizedGenerateReqInput)
        for step in range(1, STEPS + 1):  # every step's output waits before the loop reads
            outbox.send_pyobj(stand_in_step(req.rid, step))
        await asyncio.sleep(0.2)  # all of them reach the socket
        return [await first] + [out async for out in events]

    try:
        outs = asyncio.run(run())
    finally:
        tm.close()
        inbox.close()
        outbox.close()
        ctx.term()
        port_args.cleanup()
    last = outs[-1]
    assert last["output_ids"] == [100 + s for s in range(1, STEPS + 1)]
    assert last["text"] == "".join(f" t{s}" for s in range(1, STEPS + 1))
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": STEPS}
    # One event per reader callback at most (4 here), not one per step (197).
    assert len(outs) <= STEPS // DRAIN_BATCH + 1, [len(o["output_ids"]) for o in outs]
