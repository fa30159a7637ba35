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
import contextlib
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
    """Sends an already-produced first chunk, then the rest; always closes the stream."""

    def __init__(self, first: bytes, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._first = first
        self._events = events

    async def stream_response(self, send: Send) -> None:
        # Starlette leaves the iterator open when it is cancelled mid-send (disconnect).
        async with contextlib.aclosing(self._events):
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self._first, "more_body": True})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


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
        return SSEResponse(keepalive, _after_keepalives(first, events, keepalive))
    try:
        head = first.result()
    except RequestError as err:
        return request_error_response(err)
    except StopAsyncIteration:
        head = SSE_DONE
    return SSEResponse(head, events)


async def _after_keepalives(
    first: asyncio.Future[bytes], events: AsyncGenerator[bytes, None], keepalive: bytes
) -> AsyncGenerator[bytes, None]:
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=KEEPALIVE_INTERVAL_S)
            if not first.done():
                yield keepalive
        try:
            yield first.result()
        except StopAsyncIteration:
            return
        except RequestError as err:
            yield sse_error_event(err.message, err.status_code, err.param)
            yield SSE_DONE
            return
        except Exception as err:  # the response has started: report it, do not raise
            logger.exception("Stream failed before its first event")
            yield sse_error_event(f"Internal server error: {type(err).__name__}: {err}")
            yield SSE_DONE
            return
        async for event in events:
            yield event
    finally:
        await _close(first, events)


async def _close(first: asyncio.Future[bytes], events: AsyncGenerator[bytes, None]) -> None:
    # A generator cannot be closed while a task is inside it: cancel the task first.
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()
