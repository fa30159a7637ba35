"""Decode side of disaggregation, driven by the scheduler once per step.

    arrival (with bootstrap room) ──▶ pre-allocation queue ──(a row and prompt_len KV slots
    are free)──▶ KVRegister sent to the prefill server ──▶ transfer queue ──(KVTransferDone)──▶
    the request joins the running batch with its first token (no prefill here).

The prefill side reports a failure (`KVTransferDone(ok=False)`): it will not write, so the
request finishes with an abort and its slots are freed without entering the radix tree.

An abort or a timeout here, once the slots were announced in `KVRegister`: the prefill side
may still write them, so they go to the KV manager's quarantine (not free, counted as used)
and the prefill side gets a `KVCancel`. The quarantine ends when the prefill side answers
(`KVCancelAck`, or a `KVTransferDone` that crossed the cancel) or, unacknowledged, after
`--disaggregation-quarantine-timeout` with a warning. Requests without bootstrap info are
served as usual (aggregated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disagg.base import KVArgs, KVCancel, KVCancelAck, KVPoll, KVRegister, KVTransferDone
from disagg.bootstrap import BootstrapClient
from disagg.port import DisaggSide, SchedulerPort
from disagg.transfer import create_transfer_backend

if TYPE_CHECKING:
    from managers.req import Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Quarantined:
    """Slots of a given-up room, held until its prefill server is done with them."""

    peer: tuple[str, int]  # the prefill server's bootstrap address, for the log
    num_slots: int
    deadline: float  # released unacknowledged after this (monotonic seconds)


class DecodeDisagg(DisaggSide):
    def __init__(self, args: ServerArgs, port: SchedulerPort, kv: KVArgs) -> None:
        self.port = port
        self.timeout_s = args.disaggregation_timeout
        self.quarantine_timeout_s = args.disaggregation_quarantine_timeout
        self.transfer = create_transfer_backend(args.disaggregation_transfer_backend, kv, args.host)
        self.peer = self.transfer.peer_info()
        self.layout = kv.layout()
        self.client = BootstrapClient()
        self.prealloc_queue: list[tuple[Req, float]] = []
        self.transfer_queue: dict[int, tuple[Req, list[int], float]] = {}  # by room
        self.quarantine: dict[int, Quarantined] = {}  # by room; the slots are the KV manager's

    def __bool__(self) -> bool:
        # Quarantined slots belong to no request: the server may go idle while it waits.
        return bool(self.prealloc_queue or self.transfer_queue)

    def __len__(self) -> int:
        return len(self.prealloc_queue) + len(self.transfer_queue)

    def add(self, req: Req) -> None:
        assert req.disagg is not None
        room = req.disagg.room
        if self._room_in_use(room):
            # Two requests of one room would share the prefill side's bookkeeping.
            req.disagg.poll = KVPoll.Failed
            self.port.finish(req, f"bootstrap room {room} is already in use on this server")
            return
        self.prealloc_queue.append((req, time.monotonic() + self.timeout_s))

    def _room_in_use(self, room: int) -> bool:
        if room in self.transfer_queue or room in self.quarantine:
            return True
        return any(r.disagg is not None and r.disagg.room == room for r, _ in self.prealloc_queue)

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [r for r, _ in self.prealloc_queue if pred(r)]
        self.prealloc_queue = [(r, t) for r, t in self.prealloc_queue if not pred(r)]
        for room, (req, _, _) in list(self.transfer_queue.items()):
            if pred(req):
                del self.transfer_queue[room]
                self._cancel(req, "aborted on the decode server")
                gone.append(req)
        return gone

    # ---- per step ------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        self.transfer.progress()  # inbound writes of libraries without their own threads
        self._preallocate(now)
        for msg in self.client.recv_all():
            if isinstance(msg, KVTransferDone) and msg.room in self.transfer_queue:
                req, slots, _ = self.transfer_queue.pop(msg.room)
                self._on_done(req, slots, msg)
            elif isinstance(msg, (KVCancelAck, KVTransferDone)) and msg.room in self.quarantine:
                # The prefill side is done with the room's slots (a done message that crossed
                # our cancel says so too; its KV is not used).
                self.port.release_quarantine(msg.room)
                del self.quarantine[msg.room]
        for room, (req, _, deadline) in list(self.transfer_queue.items()):
            if now > deadline:
                del self.transfer_queue[room]
                self._cancel(req, "timed out waiting for the KV transfer")
                assert req.disagg is not None
                req.disagg.poll = KVPoll.Failed
                self.port.finish(req, "KV transfer from the prefill server timed out")
        self._expire_quarantine(now)

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
        """The prefill side will not write: free the preallocated slots without caching them
        (no valid KV) and fail the request."""
        assert req.disagg is not None
        req.disagg.poll = KVPoll.Failed
        self.port.release(req, cache=False)
        self.port.finish(req, message)

    # ---- giving a room up: cancel and quarantine ---------------------------------------
    def _cancel(self, req: Req, reason: str) -> None:
        """The request's slots were announced to its prefill server: quarantine them and ask
        that server to drop the room. Finishing the request is the caller's part."""
        assert req.disagg is not None
        host, port, room = req.disagg.bootstrap
        n = self.port.quarantine(req, room)
        self.quarantine[room] = Quarantined(
            (host, port), n, time.monotonic() + self.quarantine_timeout_s
        )
        self.client.send(host, port, KVCancel(room, reason))
        logger.info(
            "Room %d %s: %d KV slots quarantined until prefill server %s:%d acknowledges.",
            room,
            reason,
            n,
            host,
            port,
        )

    def _expire_quarantine(self, now: float) -> None:
        """Release quarantines past the bound: one warning per silent prefill server."""
        released: dict[tuple[str, int], list[Quarantined]] = {}
        for room, q in list(self.quarantine.items()):
            if now > q.deadline:
                del self.quarantine[room]
                self.port.release_quarantine(room)
                released.setdefault(q.peer, []).append(q)
        for (host, port), gone in released.items():
            logger.warning(
                "KV quarantine timed out: prefill server %s:%d did not acknowledge the cancel "
                "of %d room(s) within %.0f s; releasing %d KV slots (a write arriving later "
                "would corrupt other requests' KV).",
                host,
                port,
                len(gone),
                self.quarantine_timeout_s,
                sum(q.num_slots for q in gone),
            )
