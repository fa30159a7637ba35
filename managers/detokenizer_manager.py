"""The detokenizer process: token ids in, text out, one `IncrementalDecoder` per request.

    scheduler ──BatchTokenIDOut──▶ detokenizer ──BatchStrOut──▶ tokenizer manager

Decoding is incremental (only the window since the last complete character is decoded) and
holds back text that could still become a stop string; see `managers/detokenize.py`. State
for a request is dropped when it finishes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq

from managers.detokenize import IncrementalDecoder
from managers.io_struct import BatchStrOut, BatchTokenIDOut, ReqOutput, ReqStrOutput
from srt.server_args import ServerArgs
from srt.utils.process import PortArgs, become_child, parent_alive, zmq_socket

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


class DetokenizerManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDecoder] = {}
        self.output_ids: dict[str, list[int]] = {}

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        return BatchStrOut([ReqStrOutput(out, self.step(out)) for out in batch.outputs])

    def step(self, out: ReqOutput) -> str:
        """The text this request releases with `out`."""
        if self.tokenizer is None:
            return ""
        decoder = self.decoders.get(out.rid)
        if decoder is None:
            opts = out.decode_options
            decoder = self.decoders[out.rid] = IncrementalDecoder(
                self.tokenizer,
                skip_special_tokens=opts.skip_special_tokens,
                spaces_between_special_tokens=opts.spaces_between_special_tokens,
                stop=list(opts.stop),
                no_stop_trim=opts.no_stop_trim,
            )
            self.output_ids[out.rid] = []
        ids = self.output_ids[out.rid]
        ids.extend(out.new_token_ids)
        text = decoder.step(ids, out.finish_reason)
        if out.finish_reason is not None:
            del self.decoders[out.rid], self.output_ids[out.rid]
        return text


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, model_path: str, parent_pid: int
) -> None:
    become_child("detokenizer", server_args.log_level, parent_pid)
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        from srt.model_loader.sources import get_decoding_tokenizer

        tokenizer = get_decoding_tokenizer(model_path, server_args.tokenizer_path)
    manager = DetokenizerManager(tokenizer)
    ctx = zmq.Context(1)
    recv = zmq_socket(ctx, zmq.PULL, port_args.detokenizer_ipc, bind=True)
    send = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
    logger.info("Detokenizer ready (pid %d).", os.getpid())
    while True:
        if not recv.poll(IDLE_POLL_MS):
            if not parent_alive(parent_pid):
                return
            continue
        send.send_pyobj(manager.handle(recv.recv_pyobj()))
