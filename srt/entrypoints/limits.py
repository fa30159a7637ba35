"""`BodyLimitMiddleware`: refuse a request body over `--max-request-bytes` with a 413 before
it is read whole, so one large upload cannot occupy the event loop."""

from __future__ import annotations

from typing import Any

from managers.errors import RequestError
from srt.entrypoints.http_errors import request_error_response


class BodyLimitMiddleware:
    """Pure ASGI: a request body over `max_bytes` answers 413 before it is read whole, at
    once from its Content-Length, or as soon as a chunked upload passes the limit. Without
    it a route would buffer and parse any body, however large."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> RequestError:
        return RequestError(
            f"The request body is larger than this server accepts ({self.max_bytes} bytes, "
            "--max-request-bytes).",
            status_code=413,
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await request_error_response(self.too_large())(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large()  # the app's error handlers answer 413
            return message

        await self.app(scope, counting_receive, send)
