"""Prefill side of disaggregation, driven by the scheduler once per step.

    arrival (with bootstrap room) ──▶ bootstrap queue ──(decode's KVRegister arrived)──▶
    waiting queue ──▶ prefill forward (first token) ──▶ inflight: KV written to the decode
    slots on a transfer thread ──▶ KVTransferDone to decode; the request finishes here and
    its KV goes to this server's radix tree.

Requests without bootstrap info are served as usual (aggregated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from disagg.base import KVArgs, KVPoll, KVRegister, KVTransferDone
from disagg.bootstrap import BootstrapServer
from disagg.port import DisaggSide, SchedulerPort
from disagg.transfer import create_transfer_backend

if TYPE_CHECKING:
    from managers.req import Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class PrefillDisagg(DisaggSide):
    def __init__(self, args: ServerArgs, port: SchedulerPort, kv: KVArgs) -> None:
        self.port = port
        self.timeout_s = args.disaggregation_timeout
        self.transfer = create_transfer_backend(args.disaggregation_transfer_backend, kv, args.host)
        self.server = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
        self.layout = kv.layout()
        self.registrations: dict[int, tuple[bytes, KVRegister, float]] = {}
        self.claimed: dict[int, tuple[bytes, KVRegister]] = {}
        self.bootstrap_queue: list[tuple[Req, float]] = []
        self.inflight: list[tuple[Req, bytes, KVRegister, Future[list[bytes] | None]]] = []
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")

    def __bool__(self) -> bool:
        return bool(self.bootstrap_queue or self.inflight)

    def add(self, req: Req) -> None:
        self.bootstrap_queue.append((req, time.monotonic() + self.timeout_s))

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        gone = [r for r, _ in self.bootstrap_queue if pred(r)]
        self.bootstrap_queue = [(r, t) for r, t in self.bootstrap_queue if not pred(r)]
        return gone

    # ---- per step ------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        for identity, msg in self.server.recv_all():
            if isinstance(msg, KVRegister):
                if tuple(msg.layout) != self.layout:
                    self._reply(identity, msg.room, f"KV layout {msg.layout} != {self.layout}")
                    continue
                self.registrations[msg.room] = (identity, msg, now)
        self._admit_registered(now)
        self._finish_transfers()
        # Registrations whose request never came here are dropped after the timeout.
        for room, (identity, _, t) in list(self.registrations.items()):
            if now - t > self.timeout_s:
                del self.registrations[room]
                self._reply(identity, room, "the prefill server never received this request")

    def _admit_registered(self, now: float) -> None:
        keep = []
        for req, deadline in self.bootstrap_queue:
            assert req.disagg is not None
            room = req.disagg.room
            entry = self.registrations.get(room)
            if entry is not None and len(entry[1].dst_slots) == len(req.origin_input_ids):
                # Claimed: the registration now travels with the request, so the cleanup of
                # unclaimed registrations below can never take it from under a prefill.
                del self.registrations[room]
                self.claimed[room] = entry[:2]
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
        written to decode."""
        if not req.waits_for_kv_transfer():
            return False
        assert req.disagg is not None
        identity, reg = self.claimed.pop(req.disagg.room)
        src = self.port.kv_slots(req, len(req.origin_input_ids))
        req.disagg.poll = KVPoll.Transferring
        future = self.executor.submit(self._write, reg, src)
        self.inflight.append((req, identity, reg, future))
        return True

    def _write(self, reg: KVRegister, src: list[int]) -> list[bytes] | None:
        self.transfer.write(reg.peer, src, reg.dst_slots)
        return self.transfer.payload(src)

    def _finish_transfers(self) -> None:
        keep = []
        for req, identity, reg, future in self.inflight:
            if not future.done():
                keep.append((req, identity, reg, future))
                continue
            try:
                payload = future.result()
            except Exception as e:  # noqa: BLE001 - reported to both sides, never raised
                logger.error("KV transfer for room %d failed: %s", reg.room, e)
                self._reply(identity, reg.room, f"KV transfer failed: {e}")
                self.port.release(req, cache=True)
                self._fail(req, f"KV transfer failed: {e}")
                continue
            done = KVTransferDone(
                reg.room, True, req.output_ids[0], req.cached_tokens, payload=payload
            )
            self.server.send(identity, done)
            assert req.disagg is not None
            req.disagg.poll = KVPoll.Success
            self.port.release(req, cache=True)
            self.port.finish(req)
        self.inflight = keep

    def _reply(self, identity: bytes, room: int, error: str) -> None:
        self.server.send(identity, KVTransferDone(room, False, error=error))

    def _fail(self, req: Req, message: str) -> None:
        assert req.disagg is not None
        req.disagg.poll = KVPoll.Failed
        self.port.finish(req, message)
