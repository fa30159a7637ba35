"""Error messages are capped at the HTTP edge: a message that quotes what
the client sent (a model name, a compiler's view of a schema) cannot make a large body."""

from __future__ import annotations

import orjson

from managers.errors import RequestError
from srt.entrypoints.http_errors import (
    MAX_ERROR_MESSAGE_CHARS,
    capped,
    request_error_response,
    sse_error_event,
)


def test_error_messages_are_capped() -> None:
    long = "x" * 100_000
    resp = request_error_response(RequestError(long, "p" * 10_000, 404))
    body = orjson.loads(resp.body)
    assert resp.status_code == 404 and len(resp.body) < 2 * MAX_ERROR_MESSAGE_CHARS
    assert body["error"]["message"].endswith("[100000 characters, cut]")
    event = sse_error_event(long, 400)
    assert len(event) < 2 * MAX_ERROR_MESSAGE_CHARS
    short = request_error_response(RequestError("short", "stop"))
    assert orjson.loads(short.body)["error"] == {
        "message": "short",
        "type": "BadRequestError",
        "param": "stop",
        "code": 400,
    }


def test_capped_keeps_short_text() -> None:
    assert capped("abc", 3) == "abc"
    cut = capped("x" * 50, 40)
    assert len(cut) == 40 and cut.endswith("[50 characters, cut]")
