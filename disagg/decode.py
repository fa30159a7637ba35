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
from typing import TYPE_CHECKING, Any

import torch

from disagg.base import KVArgs, KVPoll, KVRegister, KVTransferDone
from disagg.bootstrap import BootstrapClient
from disagg.transfer import create_transfer_backend

if TYPE_CHECKING:
    from managers.req import Req

logger = logging.getLogger(__name__)


class DecodeDisagg:
    def __init__(self, scheduler: Any, kv: KVArgs) -> None:
        args = scheduler.server_args
        self.scheduler = scheduler
        self.timeout_s = args.disaggregation_timeout
        self.transfer = create_transfer_backend(args.disaggregation_transfer_backend, kv, args.host)
        self.peer = self.transfer.peer_info()
        self.layout = kv.layout()
        self.client = BootstrapClient()
        self.prealloc_queue: list[tuple[Req, float]] = []
        self.transfer_queue: dict[int, tuple[Req, list[int], float]] = {}

    def __bool__(self) -> bool:
        return bool(self.prealloc_queue or self.transfer_queue)

    def add(self, req: Req) -> None:
        req.kv_poll = KVPoll.Bootstrapping
        self.prealloc_queue.append((req, time.monotonic() + self.timeout_s))

    def remove_if(self, pred: Any) -> list[Req]:
        gone = [r for r, _ in self.prealloc_queue if pred(r)]
        self.prealloc_queue = [(r, t) for r, t in self.prealloc_queue if not pred(r)]
        for room, (req, slots, _) in list(self.transfer_queue.items()):
            if pred(req):
                del self.transfer_queue[room]
                self._release(req, slots)
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
        for room, (req, slots, deadline) in list(self.transfer_queue.items()):
            if now > deadline:
                del self.transfer_queue[room]
                self._release(req, slots)
                self._fail(req, "KV transfer from the prefill server timed out")

    def _preallocate(self, now: float) -> None:
        keep = []
        for req, deadline in self.prealloc_queue:
            slots = self._allocate(req)
            if slots is not None:
                host, port, room = req.bootstrap
                req.kv_poll = KVPoll.WaitingForInput
                self.client.send(host, port, KVRegister(room, slots, self.layout, self.peer))
                self.transfer_queue[room] = (req, slots, now + self.timeout_s)
            elif now > deadline:
                self._fail(req, "no KV memory for this request on the decode server in time")
            else:
                keep.append((req, deadline))
        self.prealloc_queue = keep

    def _allocate(self, req: Req) -> list[int] | None:
        sched = self.scheduler
        n = len(req.origin_input_ids)
        # Leave room for the running requests' next decode step.
        need = n + sched.page_size + sched.running_batch.decode_tokens_needed()
        free = sched.allocator.available_size() + sched.tree_cache.evictable_size()
        if need > free or sched.req_to_token_pool.available_size() == 0:
            return None
        short = n + sched.page_size - sched.allocator.available_size()
        if short > 0:
            sched.tree_cache.evict(short)
        loc = sched.allocator.alloc_extend([0], [n], [-1])
        if loc is None:
            return None
        [row] = sched.req_to_token_pool.alloc(1)
        sched.req_to_token_pool.req_to_token[row, :n] = loc.to(torch.int32)
        req.req_pool_idx = row
        req.kv_allocated_len = n
        req.cache_protected_len = 0
        req.last_node = getattr(sched.tree_cache, "root_node", None)
        return loc.tolist()

    def _on_done(self, req: Req, slots: list[int], msg: KVTransferDone) -> None:
        if not msg.ok:
            self._release(req, slots)
            self._fail(req, f"prefill server: {msg.error}")
            return
        if msg.payload is not None:
            self.transfer.receive_payload(slots, msg.payload)
        req.kv_poll = KVPoll.Success
        req.admitted = True
        req.cached_tokens = msg.cached_tokens
        req.output_ids.append(msg.first_token)
        req.check_finished(self.scheduler.context_len, self.scheduler._tail_text)
        if req.finished():
            self.scheduler.tree_cache.cache_finished_req(req)
        else:
            self.scheduler.running_batch.reqs.append(req)
        self.scheduler.emit([req])

    def _release(self, req: Req, slots: list[int]) -> None:
        """Free a request's pre-allocated slots and row; never cache them (no valid KV)."""
        sched = self.scheduler
        sched.allocator.free(torch.tensor(slots, dtype=torch.int64))
        sched.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_allocated_len = 0
        req.last_node = None

    def _fail(self, req: Req, message: str) -> None:
        req.kv_poll = KVPoll.Failed
        self.scheduler.fail_request(req, message, 500)
