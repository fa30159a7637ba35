"""`Port`: the scheduler's side of the interface to disaggregation (`disagg/port.py`).

Everything a prefill or decode side may ask of the scheduler goes through these methods, so
the disaggregation code never touches the queues or the KV pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from managers.io_struct import finish_abort

if TYPE_CHECKING:
    from managers.req import Req
    from managers.scheduler.deadlines import Deadlines
    from managers.scheduler.emitter import Emitter
    from managers.scheduler.queues import Queues
    from mem_cache.kv_manager import KVManager


class Port:
    def __init__(
        self, queues: Queues, kv: KVManager, emitter: Emitter, deadlines: Deadlines
    ) -> None:
        self.queues = queues
        self.kv = kv
        self.emitter = emitter
        self.deadlines = deadlines

    def preallocate(self, req: Req) -> list[int] | None:
        # Leave room for the running requests' next decode step.
        reserve = self.kv.decode_tokens_needed(r.kv for r in self.queues.running)
        return self.kv.preallocate(req.kv, len(req.origin_input_ids), reserve)

    def kv_slots(self, req: Req, n: int) -> list[int]:
        return self.kv.slots(req.kv, n)

    def admit_waiting(self, req: Req) -> None:
        self.queues.waiting.append(req)

    def admit_running(self, req: Req, first_token: int, cached_tokens: int) -> None:
        self.deadlines.admitted(req)  # admitted here, not by a prefill batch
        req.cached_tokens = cached_tokens
        req.output_ids.append(first_token)
        self.emitter.check_finished(req)
        if req.finished():
            self.kv.cache_finished(req)
        else:
            self.queues.running.append(req)
        self.emitter.emit([req])

    def release(self, req: Req, cache: bool) -> None:
        if cache:
            self.kv.cache_finished(req)
        else:
            self.kv.release_uncached(req.kv)

    def finish(self, req: Req, error: str | None = None) -> None:
        if error is None:
            self.emitter.emit([req])
        else:
            self.emitter.fail(req, error, 500)

    def abort(self, req: Req, message: str) -> None:
        if req.finished():
            return
        waiting = self.queues.waiting
        for i, queued in enumerate(waiting):
            if queued is req:  # no KV yet
                del waiting[i]
                self.emitter.fail(req, message)
                return
        if req.to_abort is None:
            req.to_abort = finish_abort(message)  # applied to its next result

    def quarantine(self, req: Req, key: int) -> int:
        return self.kv.quarantine(key, req.kv)

    def release_quarantine(self, key: int) -> int:
        return self.kv.release_quarantine(key)
