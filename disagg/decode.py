"""Decode side of disaggregation, driven by the scheduler once per step.

    arrival (with bootstrap room) ──▶ pre-allocation queue ──(a row and prompt_len KV slots
    are free)──▶ KVRegister sent to the prefill server ──▶ transfer queue ──(KVTransferDone)──▶
    the request joins the running batch with its first token (no prefill here).

Failure or timeout: the request finishes with an abort and its slots are freed without
entering the radix tree (their KV was never written). Requests without bootstrap info are
served as usual (aggregated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from disagg.base import KVArgs, KVPoll, KVRegister, KVTransferDone
from disagg.bootstrap import BootstrapClient
from disagg.port import DisaggSide, SchedulerPort
from disagg.transfer import create_transfer_backend

if TYPE_CHECKING:
    from managers.req import Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class DecodeDisagg(DisaggSide):
    def __init__(self, args: ServerArgs, port: SchedulerPort, kv: KVArgs) -> None:
        self.port = port
        self.timeout_s = args.disaggregation_timeout
        self.transfer = create_transfer_backend(args.disaggregation_transfer_backend, kv, args.host)
        self.peer = self.transfer.peer_info()
        self.layout = kv.layout()
        self.client = BootstrapClient()
        self.prealloc_queue: list[tuple[Req, float]] = []
        self.transfer_queue: dict[int, tuple[Req, list[int], float]] = {}  # by room

    def __bool__(self) -> bool:
        return bool(self.prealloc_queue or self.transfer_queue)

    def add(self, req: Req) -> None:
        self.prealloc_queue.append((req, time.monotonic() + self.timeout_s))

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [r for r, _ in self.prealloc_queue if pred(r)]
        self.prealloc_queue = [(r, t) for r, t in self.prealloc_queue if not pred(r)]
        for room, (req, _, _) in list(self.transfer_queue.items()):
            if pred(req):
                del self.transfer_queue[room]
                self.port.release(req, cache=False)
                gone.append(req)
        return gone

    # ---- per step ------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        self._preallocate(now)
        for msg in self.client.recv_all():
            if isinstance(msg, KVTransferDone) and msg.room in self.transfer_queue:
                req, slots, _ = self.transfer_queue.pop(msg.room)
                self._on_done(req, slots, msg)
        for room, (req, _, deadline) in list(self.transfer_queue.items()):
            if now > deadline:
                del self.transfer_queue[room]
                self._fail(req, "KV transfer from the prefill server timed out")

    def _preallocate(self, now: float) -> None:
        keep = []
        for req, deadline in self.prealloc_queue:
            slots = self.port.preallocate(req)
            if slots is not None:
                assert req.disagg is not None
                host, port, room = req.disagg.bootstrap
                req.disagg.poll = KVPoll.WaitingForInput
                self.client.send(host, port, KVRegister(room, slots, self.layout, self.peer))
                self.transfer_queue[room] = (req, slots, now + self.timeout_s)
            elif now > deadline:
                assert req.disagg is not None
                req.disagg.poll = KVPoll.Failed
                self.port.finish(req, "no KV memory for this request on the decode server in time")
            else:
                keep.append((req, deadline))
        self.prealloc_queue = keep

    def _on_done(self, req: Req, slots: list[int], msg: KVTransferDone) -> None:
        if not msg.ok:
            self._fail(req, f"prefill server: {msg.error}")
            return
        if msg.payload is not None:
            self.transfer.receive_payload(slots, msg.payload)
        assert req.disagg is not None
        req.disagg.poll = KVPoll.Success
        self.port.admit_running(req, msg.first_token, msg.cached_tokens)

    def _fail(self, req: Req, message: str) -> None:
        """Free a request's preallocated slots without caching them (no valid KV) and fail it."""
        assert req.disagg is not None
        req.disagg.poll = KVPoll.Failed
        self.port.release(req, cache=False)
        self.port.finish(req, message)
