"""Prefill side of disaggregation, driven by the scheduler once per step.

    arrival (with bootstrap room) ──▶ bootstrap queue ──(decode's KVRegister arrived)──▶
    waiting queue ──▶ prefill forward (first token) ──▶ inflight: KV written to the decode
    slots on a transfer thread ──▶ KVTransferDone to decode; the request finishes here and
    its KV goes to this server's radix tree.

A room is in exactly one place here: `registrations` (decode registered, the request has not
arrived), `claimed` (the request is queued or in a forward), `inflight` (its write runs), or
gone. A `KVCancel` from decode drops it from wherever it is: an unstarted write is never
started, a running one is allowed to end; then `KVCancelAck` tells decode its slots are no
longer written, and the request here finishes with an abort (its KV is cached here as usual).
A request that finishes here without its KV sent (aborted by its own client or a time limit)
answers decode with a failure, so decode frees its slots at once. A room dropped either way
is remembered for `--disaggregation-timeout`, so whichever of its request or registration
arrives late is refused at once.

Requests without bootstrap info are served as usual (aggregated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disagg.base import KVArgs, KVCancel, KVCancelAck, KVPoll, KVRegister, KVTransferDone
from disagg.bootstrap import BootstrapServer
from disagg.port import DisaggSide, SchedulerPort
from disagg.transfer import create_transfer_backend

if TYPE_CHECKING:
    from managers.req import Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CANCELLED = "cancelled by the decode server"


@dataclass(slots=True)
class Claim:
    """A registered room whose request is admitted here (queued or in a forward)."""

    identity: bytes  # the decode server's connection
    reg: KVRegister
    req: Req


@dataclass(slots=True)
class Transfer:
    """A room whose KV write was submitted to the transfer thread."""

    req: Req
    identity: bytes
    reg: KVRegister
    future: Future[list[bytes] | None]
    cancelled: bool = False


class PrefillDisagg(DisaggSide):
    def __init__(self, args: ServerArgs, port: SchedulerPort, kv: KVArgs) -> None:
        self.port = port
        self.timeout_s = args.disaggregation_timeout
        self.transfer = create_transfer_backend(args.disaggregation_transfer_backend, kv, args.host)
        self.server = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
        self.layout = kv.layout()
        self.registrations: dict[int, tuple[bytes, KVRegister, float]] = {}
        self.claimed: dict[int, Claim] = {}
        self.bootstrap_queue: list[tuple[Req, float]] = []
        self.inflight: list[Transfer] = []
        self.dropped: dict[int, tuple[str, float]] = {}  # room -> (why, refused until)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")

    def __bool__(self) -> bool:
        return bool(self.bootstrap_queue or self.inflight)

    def __len__(self) -> int:
        return len(self.bootstrap_queue)  # the inflight ones finished their prefill

    def add(self, req: Req) -> None:
        self.bootstrap_queue.append((req, time.monotonic() + self.timeout_s))

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [r for r, _ in self.bootstrap_queue if pred(r)]
        self.bootstrap_queue = [(r, t) for r, t in self.bootstrap_queue if not pred(r)]
        now = time.monotonic()
        for req in gone:
            assert req.disagg is not None
            room = req.disagg.room
            entry = self.registrations.pop(room, None)
            if entry is not None:  # decode is waiting: let it free its slots now
                self._reply(entry[0], room, "request aborted")
            else:
                self.dropped[room] = ("request aborted", now + self.timeout_s)
        return gone

    # ---- per step ------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        for identity, msg in self.server.recv_all():
            if isinstance(msg, KVRegister):
                if tuple(msg.layout) != self.layout:
                    self._reply(identity, msg.room, f"KV layout {msg.layout} != {self.layout}")
                    continue
                if msg.room in self.dropped:
                    self._reply(identity, msg.room, self.dropped[msg.room][0])
                    continue
                self.registrations[msg.room] = (identity, msg, now)
            elif isinstance(msg, KVCancel):
                self._cancel(identity, msg.room, now)
        self._admit_registered(now)
        self._finish_transfers()
        self._drop_abandoned_claims()
        # Registrations whose request never came here are dropped after the timeout.
        for room, (identity, _, t) in list(self.registrations.items()):
            if now - t > self.timeout_s:
                del self.registrations[room]
                self._reply(identity, room, "the prefill server never received this request")
        for room, (_, until) in list(self.dropped.items()):
            if now > until:
                del self.dropped[room]

    def _admit_registered(self, now: float) -> None:
        keep = []
        for req, deadline in self.bootstrap_queue:
            assert req.disagg is not None
            room = req.disagg.room
            entry = self.registrations.get(room)
            if room in self.dropped:
                self._fail(req, self.dropped[room][0])
            elif entry is not None and len(entry[1].dst_slots) == len(req.origin_input_ids):
                # Claimed: the registration now travels with the request, so the cleanup of
                # unclaimed registrations below can never take it from under a prefill.
                del self.registrations[room]
                self.claimed[room] = Claim(entry[0], entry[1], req)
                req.disagg.poll = KVPoll.WaitingForInput
                self.port.admit_waiting(req)
            elif entry is not None:
                del self.registrations[room]
                self._reply(entry[0], room, "decode allocated a different number of slots")
                self._fail(req, "decode allocated a different number of KV slots")
            elif now > deadline:
                self._fail(req, "no decode server registered for this request in time")
            else:
                keep.append((req, deadline))
        self.bootstrap_queue = keep

    def take_finished(self, req: Req) -> bool:
        """A finished request whose prompt KV and first token exist: keep it until they are
        written to decode. One aborted here (its client, a time limit) sends nothing."""
        if not req.waits_for_kv_transfer():
            return False
        assert req.disagg is not None
        claim = self.claimed.pop(req.disagg.room)
        reason = req.finished_reason
        if reason is not None and reason.type == "abort":
            req.disagg.poll = KVPoll.Failed
            self._reply(claim.identity, claim.reg.room, f"request aborted: {reason.message}")
            return False
        src = self.port.kv_slots(req, len(req.origin_input_ids))
        req.disagg.poll = KVPoll.Transferring
        future = self.executor.submit(self._write, claim.reg, src)
        self.inflight.append(Transfer(req, claim.identity, claim.reg, future))
        return True

    def _write(self, reg: KVRegister, src: list[int]) -> list[bytes] | None:
        self.transfer.write(reg.peer, src, reg.dst_slots)
        return self.transfer.payload(src)

    def _finish_transfers(self) -> None:
        keep = []
        for t in self.inflight:
            if not t.future.done():
                keep.append(t)
                continue
            room, req = t.reg.room, t.req
            self.port.release(req, cache=True)  # this server's KV is valid either way
            if t.cancelled:
                # Never started, or ended: nothing more lands in decode's slots.
                self.server.send(t.identity, KVCancelAck(room))
                self._fail(req, CANCELLED)
                continue
            try:
                payload = t.future.result()
            except Exception as e:  # noqa: BLE001 - reported to both sides, never raised
                logger.error("KV transfer for room %d failed: %s", room, e)
                self._reply(t.identity, room, f"KV transfer failed: {e}")
                self._fail(req, f"KV transfer failed: {e}")
                continue
            done = KVTransferDone(room, True, req.output_ids[0], req.cached_tokens, payload=payload)
            self.server.send(t.identity, done)
            assert req.disagg is not None
            req.disagg.poll = KVPoll.Success
            self.port.finish(req)
        self.inflight = keep

    # ---- cancellation and cleanup --------------------------------------------------------
    def _cancel(self, identity: bytes, room: int, now: float) -> None:
        """Decode gave the room up: drop it wherever it is; acknowledge once no write of it
        can land any more (at once unless a write is running)."""
        for t in self.inflight:
            if t.reg.room == room:
                t.cancelled = True
                t.future.cancel()  # succeeds only if the write has not started
                return  # acknowledged by `_finish_transfers` when the write is over
        claim = self.claimed.pop(room, None)
        if claim is not None:
            assert claim.req.disagg is not None
            claim.req.disagg.poll = KVPoll.Failed  # `take_finished` will not send it
            self.port.abort(claim.req, CANCELLED)
        else:
            self.registrations.pop(room, None)
            self.dropped[room] = (CANCELLED, now + self.timeout_s)  # its request may still come
        self.server.send(identity, KVCancelAck(room))

    def _drop_abandoned_claims(self) -> None:
        """Claimed rooms whose request finished without reaching `take_finished` (aborted
        while queued): tell decode, which then frees its slots."""
        for room, claim in list(self.claimed.items()):
            if claim.req.finished():
                del self.claimed[room]
                self._reply(claim.identity, room, "request aborted")

    def _reply(self, identity: bytes, room: int, error: str) -> None:
        self.server.send(identity, KVTransferDone(room, False, error=error))

    def _fail(self, req: Req, message: str) -> None:
        assert req.disagg is not None
        req.disagg.poll = KVPoll.Failed
        self.port.finish(req, message)
