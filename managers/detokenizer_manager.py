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
from managers.io_struct import BatchStrOut, BatchTokenIDOut
from srt.server_args import ServerArgs
from srt.utils.process import PortArgs, become_child, parent_alive, zmq_socket

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


class DetokenizerManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDecoder] = {}
        self.output_ids: dict[str, list[int]] = {}

    def handle(self, out: BatchTokenIDOut) -> BatchStrOut:
        texts: list[str] = []
        for i, rid in enumerate(out.rids):
            finished = out.finished_reasons[i]
            if self.tokenizer is None:
                texts.append("")
                continue
            decoder = self.decoders.get(rid)
            if decoder is None:
                opts = out.decode_options[i]
                decoder = self.decoders[rid] = IncrementalDecoder(
                    self.tokenizer,
                    skip_special_tokens=opts.skip_special_tokens,
                    spaces_between_special_tokens=opts.spaces_between_special_tokens,
                    stop=list(opts.stop),
                    no_stop_trim=opts.no_stop_trim,
                )
                self.output_ids[rid] = []
            ids = self.output_ids[rid]
            ids.extend(out.new_token_ids[i])
            texts.append(decoder.step(ids, finished))
            if finished is not None:
                del self.decoders[rid], self.output_ids[rid]
        return BatchStrOut(out, texts)


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, model_path: str, parent_pid: int
) -> None:
    become_child("detokenizer", server_args.log_level)
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        from srt.model_loader.loader import get_tokenizer

        tokenizer = get_tokenizer(model_path, server_args.tokenizer_path)
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
