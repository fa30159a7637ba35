"""`ReqState`: what the tokenizer manager knows of one running sample.

The receive loop `apply`s each `ReqOutput` of a `BatchStrOut` (text, ids, logprobs
accumulate) and `notify`s; the waiting caller takes a cumulative `snapshot`. A state is queued
at most once at a time, so a slow consumer of a stream gets the latest snapshot, not a backlog.
`wait_outputs` is the caller's side: it takes the states of one request as they come.
The finish reason stays a `FinishReason` here; only `meta_info` holds its JSON form.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from managers.errors import RequestError
from managers.io_struct import FinishReason, LogprobDelta, ReqOutput, finish_abort

logger = logging.getLogger(__name__)
# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_POLL_S = 1.0

TokenText = Callable[[int], str | None]
LOGPROB_FIELDS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


class ReqState:
    def __init__(
        self,
        rid: str,
        parent_rid: str,
        index: int,
        ready: asyncio.Queue[ReqState],
        stream: bool,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
    ) -> None:
        self.rid = rid
        self.parent_rid = parent_rid
        self.index = index
        self.ready = ready
        self.stream = stream
        self.return_text_in_logprobs = return_text_in_logprobs
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None}
        self.logprobs: dict[str, list[Any]] | None = (
            {f: [] for f in LOGPROB_FIELDS} if return_logprob else None
        )
        self.embedding: list[float] | None = None  # an embedding request's, once finished
        self.finish_reason: FinishReason | None = None
        self.finished = False
        self.queued = False
        self.created_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time = self.created_time

    def apply(self, out: ReqOutput, new_text: str, token_text: TokenText) -> None:
        self.text += new_text
        self.output_ids.extend(out.new_token_ids)
        self.meta["prompt_tokens"] = out.prompt_tokens
        self.meta["completion_tokens"] = out.completion_tokens
        self.meta["cached_tokens"] = out.cached_tokens
        if self.logprobs is not None and out.logprobs is not None:
            text = token_text if self.return_text_in_logprobs else _no_text
            _extend_logprobs(self.logprobs, out.logprobs, text)
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.finish_reason is not None:
            self.finish(out.finish_reason)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.finished = True
        self.meta["finish_reason"] = reason.to_json()  # the client's JSON shape
        self.meta["e2e_latency"] = time.perf_counter() - self.created_time

    def fail(self, message: str) -> None:
        self.finish(finish_abort(message, 503))
        self.notify()

    def notify(self) -> None:
        if (self.stream or self.finished) and not self.queued:
            self.queued = True
            self.ready.put_nowait(self)

    def snapshot(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.logprobs is not None:
            meta.update({k: list(v) for k, v in self.logprobs.items()})
        if self.embedding is not None:
            return {"index": self.index, "embedding": self.embedding, "meta_info": meta}
        return {
            "index": self.index,
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def _extend_logprobs(acc: dict[str, list[Any]], delta: LogprobDelta, text: TokenText) -> None:
    """Append `delta` to the accumulated lists in the client's [logprob, id, text] shape."""
    for f in ("input_token_logprobs", "output_token_logprobs"):
        acc[f].extend([lp, t, text(t)] for lp, t in getattr(delta, f))
    for f in ("input_top_logprobs", "output_top_logprobs"):
        acc[f].extend(
            None if tops is None else [[lp, t, text(t)] for lp, t in tops]
            for tops in getattr(delta, f)
        )


def _no_text(token_id: int) -> None:
    return None


async def wait_outputs(
    states: list[ReqState],
    ready: asyncio.Queue[ReqState],
    stream: bool,
    request: Any,
) -> AsyncIterator[dict[str, Any]]:
    """The outputs of one request's samples as they come (cumulative snapshots when
    streaming, else each sample's final one). A sample refused before anything was sent
    raises `RequestError`; a client gone (polled every `DISCONNECT_POLL_S`) ends it early.

    The disconnect poll runs beside the wait (`_watch_disconnect`), not as a timeout on each
    wait: a stream waits once per token, and a timed wait costs a task and a timer each."""
    pending = len(states)
    sent = False
    watch = None
    if request is not None:
        watch = asyncio.ensure_future(_watch_disconnect(request, ready))
    try:
        while pending:
            state = await ready.get()
            if state is _DISCONNECTED:
                logger.info("Client disconnected; aborting request %s.", states[0].parent_rid)
                return
            state.queued = False
            if state.finished:
                pending -= 1
                reason = state.finish_reason
                # Refused before anything was sent (bad input, invalid grammar, a full
                # queue, timed out waiting, a client over a cap): an error, so HTTP answers
                # 4xx / 503 instead of starting a stream.
                if reason is not None and reason.is_abort and reason.status_code and not sent:
                    if reason.status_code == 503:
                        raise RequestError.overloaded(reason.message or "")
                    if reason.status_code == 429:
                        raise RequestError.rate_limited(reason.message or "")
                    raise RequestError(reason.message or "", status_code=reason.status_code)
            if stream or state.finished:
                sent = True
                yield state.snapshot()
    finally:
        if watch is not None:
            watch.cancel()


# Put in a request's ready queue when its client went away.
_DISCONNECTED: Any = object()


async def _watch_disconnect(request: Any, ready: asyncio.Queue[Any]) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            ready.put_nowait(_DISCONNECTED)
            return
