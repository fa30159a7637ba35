"""Server-sent event streams, shared by `/generate` and the OpenAI routes.

`start_sse(events)` answers a streaming request. An error before the first event (bad input,
a full queue) is a plain JSON error response, as long as it comes within
`FIRST_EVENT_WAIT_S`. A request still queued after that gets its 200 and headers anyway,
with an SSE comment (`: keep-alive`) at once and every `KEEPALIVE_INTERVAL_S` until its
first event, so proxies with header or idle timeouts keep the connection; an error from then
on is an error event followed by `[DONE]`.

SGLang's native route sends a bare blank line instead (`NATIVE_KEEPALIVE`): SGLang's own
clients (`bench_serving`, the frontend's `RuntimeEndpoint`) parse every non-blank line of a
`/generate` stream as JSON, so a comment line would break them, while a blank line is skipped
by them and is a no-op in SSE (it dispatches an event only when data was buffered).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from fastapi import Response
from starlette.responses import StreamingResponse
from starlette.types import Send

from managers.errors import RequestError
from srt.entrypoints.http_errors import request_error_response, sse_error_event

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
NATIVE_KEEPALIVE = b"\n"
# How long a stream may wait for its first event before the response starts without it.
FIRST_EVENT_WAIT_S = 1.0
KEEPALIVE_INTERVAL_S = 5.0


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """Streams `events` after a first chunk: `first`, already produced, or the pending first
    event (`start_sse`'s slow case), awaited with `keepalive` sent every
    `KEEPALIVE_INTERVAL_S`. Always closes the stream. Each event is sent from this one loop:
    a stream of a thousand tokens crosses no extra generator per event."""

    def __init__(
        self,
        first: bytes | asyncio.Future[bytes],
        events: AsyncGenerator[bytes, None],
        keepalive: bytes = KEEPALIVE,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._first = first
        self._events = events
        self._keepalive = keepalive

    async def stream_response(self, send: Send) -> None:
        first = self._first
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if isinstance(first, bytes):
                await _send_body(send, first)
            elif not await self._after_keepalives(first, send):
                await _send_body(send, b"", more=False)
                return
            async for event in self._events:
                await _send_body(send, event)
            await _send_body(send, b"", more=False)
        finally:
            # Also when Starlette cancels us mid-send (disconnect): the pending first event's
            # task is cancelled before the generator it runs in is closed.
            if isinstance(first, asyncio.Future):
                await _close(first, self._events)
            else:
                await self._events.aclose()

    async def _after_keepalives(self, first: asyncio.Future[bytes], send: Send) -> bool:
        """Keep-alives until the first event, then it; False when the stream ends there (no
        event, or an error sent as an event)."""
        await _send_body(send, self._keepalive)  # at once: the headers go with it
        while not first.done():
            await asyncio.wait({first}, timeout=KEEPALIVE_INTERVAL_S)
            if not first.done():
                await _send_body(send, self._keepalive)
        try:
            await _send_body(send, first.result())
            return True
        except StopAsyncIteration:
            return False
        except RequestError as err:
            error = sse_error_event(err.message, err.status_code, err.param)
        except Exception as err:  # the response has started: report it, do not raise
            logger.exception("Stream failed before its first event")
            error = sse_error_event(f"Internal server error: {type(err).__name__}: {err}")
        await _send_body(send, error)
        await _send_body(send, SSE_DONE)
        return False


async def _send_body(send: Send, body: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def start_sse(events: AsyncGenerator[bytes, None], keepalive: bytes = KEEPALIVE) -> Response:
    """The response for `events` (see the module docstring). `events` raises `RequestError`
    for a refusal before its first event and turns later ones into error events itself.
    `keepalive`: what is sent while the first event is awaited."""
    first = asyncio.ensure_future(anext(events))
    try:
        await asyncio.wait({first}, timeout=FIRST_EVENT_WAIT_S)
    except BaseException:  # the client went away while we waited
        await _close(first, events)
        raise
    if not first.done():
        return SSEResponse(first, events, keepalive)
    try:
        head = first.result()
    except RequestError as err:
        return request_error_response(err)
    except StopAsyncIteration:
        head = SSE_DONE
    return SSEResponse(head, events)


async def _close(first: asyncio.Future[bytes], events: AsyncGenerator[bytes, None]) -> None:
    # A generator cannot be closed while a task is inside it: cancel the task first.
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()
