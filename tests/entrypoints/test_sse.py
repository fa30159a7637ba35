"""`start_sse`: a fast first event or error answers as before; a slow first event gets the
headers and keep-alives first, and a later error becomes an error event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import orjson
import pytest

from managers.errors import RequestError
from srt.entrypoints import sse
from srt.entrypoints.sse import KEEPALIVE, SSE_DONE, SSEResponse, start_sse


@pytest.fixture(autouse=True)
def short_waits(monkeypatch) -> None:
    monkeypatch.setattr(sse, "FIRST_EVENT_WAIT_S", 0.05)
    monkeypatch.setattr(sse, "KEEPALIVE_INTERVAL_S", 0.05)


class Source:
    """An event stream whose first event (or error) comes after `delay` seconds."""

    def __init__(self, delay: float, error: RequestError | None = None) -> None:
        self.delay = delay
        self.error = error
        self.closed = False

    async def events(self) -> AsyncGenerator[bytes, None]:
        try:
            await asyncio.sleep(self.delay)
            if self.error is not None:
                raise self.error
            yield b"data: 1\n\n"
            yield SSE_DONE
        finally:
            self.closed = True


async def body_of(resp: SSEResponse) -> list[bytes]:
    chunks: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            chunks.append(message["body"])

    await resp.stream_response(send)
    return chunks


def test_fast_first_event_starts_the_stream() -> None:
    async def go() -> list[bytes]:
        resp = await start_sse(Source(0).events())
        assert isinstance(resp, SSEResponse)
        return await body_of(resp)

    assert asyncio.run(go()) == [b"data: 1\n\n", SSE_DONE]


def test_fast_error_is_a_plain_response_with_its_headers() -> None:
    async def go():
        return await start_sse(Source(0, RequestError.overloaded("full")).events())

    resp = asyncio.run(go())
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert orjson.loads(resp.body)["error"]["message"] == "full"


def test_slow_first_event_gets_keepalives_first() -> None:
    async def go() -> list[bytes]:
        return await body_of(await start_sse(Source(0.3).events()))

    chunks = asyncio.run(go())
    assert chunks[0] == KEEPALIVE and chunks.count(KEEPALIVE) >= 2
    assert chunks[-2:] == [b"data: 1\n\n", SSE_DONE]


def test_a_slow_first_event_sends_a_keepalive_at_once(monkeypatch) -> None:
    """The headers leave with the first keep-alive, not one interval later."""
    monkeypatch.setattr(sse, "KEEPALIVE_INTERVAL_S", 30.0)

    async def go() -> list[bytes]:
        return await body_of(await start_sse(Source(0.2).events()))

    assert asyncio.run(go()) == [KEEPALIVE, b"data: 1\n\n", SSE_DONE]


def test_slow_error_becomes_an_error_event() -> None:
    async def go() -> list[bytes]:
        source = Source(0.2, RequestError.overloaded("timed out waiting"))
        return await body_of(await start_sse(source.events()))

    chunks = asyncio.run(go())
    assert chunks[0] == KEEPALIVE
    error = orjson.loads(chunks[-2][len(b"data: ") :])["error"]
    assert error["code"] == 503 and error["message"] == "timed out waiting"
    assert chunks[-1] == SSE_DONE


def test_client_gone_during_keepalives_closes_the_source() -> None:
    source = Source(10)

    async def go() -> None:
        resp = await start_sse(source.events())
        task = asyncio.ensure_future(body_of(resp))
        await asyncio.sleep(0.15)
        task.cancel()  # what Starlette does when the client disconnects
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert source.closed
