"""The narrow interface between the scheduler and a disaggregation side.

The scheduler calls a `DisaggSide` (prefill, decode, or the base class for a plain server):
`add` a request that carries bootstrap info, `poll` once per step, `remove_if` on abort,
`take_finished` when a request finishes (the prefill side keeps it until its KV reached the
decode server). The side calls back only through a `SchedulerPort`: `preallocate` and
`release` KV, `quarantine` it (decode: slots a peer may still write) and `release_quarantine`
it, `finish` or `abort` a request, `admit_waiting` (prefill: its decode peer registered) and
`admit_running` (decode: its KV and first token arrived). It never touches the scheduler's
queues or KV pools itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from disagg.base import KVArgs

if TYPE_CHECKING:
    from managers.req import Req
    from srt.server_args import ServerArgs


class SchedulerPort(Protocol):
    def preallocate(self, req: Req) -> list[int] | None:
        """A row and KV slots for the request's prompt, or None when they do not fit now."""
        ...

    def kv_slots(self, req: Req, n: int) -> list[int]:
        """The slots holding the request's first n positions."""
        ...

    def admit_waiting(self, req: Req) -> None:
        """Queue the request for prefill."""
        ...

    def admit_running(self, req: Req, first_token: int, cached_tokens: int) -> None:
        """The request's prompt KV is in its preallocated slots: decode from `first_token`."""
        ...

    def release(self, req: Req, cache: bool) -> None:
        """Free the request's KV and row: into the tree when `cache`, else straight back
        (slots whose KV was never written)."""
        ...

    def finish(self, req: Req, error: str | None = None) -> None:
        """Tell the client the request is done here (an error finishes it with a 500)."""
        ...

    def abort(self, req: Req, message: str) -> None:
        """Finish an admitted request with an abort: at once while it waits for prefill, at
        its next result while a forward has it."""
        ...

    def quarantine(self, req: Req, key: int) -> int:
        """Take the request's preallocated slots out of use without freeing them (a peer may
        still write them) and release its row; return how many slots are held."""
        ...

    def release_quarantine(self, key: int) -> int:
        """Free the slots quarantined under `key`; return how many (0 if none)."""
        ...


class DisaggSide:
    """A plain server's side: nothing is disaggregated (`--disaggregation-mode null`)."""

    def __bool__(self) -> bool:
        return False  # holds no request

    def __len__(self) -> int:
        """Requests held here that are not admitted to the scheduler's queues yet."""
        return 0

    def add(self, req: Req) -> None:
        raise ValueError("this server does not serve disaggregated requests")

    def poll(self) -> None:
        pass

    def remove_if(self, pred: Callable[[Req], bool]) -> list[Req]:
        return []

    def take_finished(self, req: Req) -> bool:
        return False


def create_disagg(server_args: ServerArgs, port: SchedulerPort, worker: Any) -> DisaggSide:
    mode = server_args.disaggregation_mode
    if mode == "null":
        return DisaggSide()
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise ValueError("disaggregation needs a model worker with a KV pool")
    kv = KVArgs.from_pool(runner.token_to_kv_pool)
    if mode == "prefill":
        from disagg.prefill import PrefillDisagg

        return PrefillDisagg(server_args, port, kv)
    from disagg.decode import DecodeDisagg

    return DecodeDisagg(server_args, port, kv)
