"""The API key: where it comes from, and the middleware that enforces it.

The key is taken from, in order: `--api-key` (visible in `ps`, so kept for local use and
tests), `--api-key-file` (its first line, stripped), then the `RADIXRT_API_KEY`
environment variable. With a key, every route but /health needs
`Authorization: Bearer <key>`; the scheme is matched case-insensitively and the key is
compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Any

from managers.errors import RequestError
from srt import environ
from srt.entrypoints.http_errors import request_error_response
from srt.server_args import ServerArgs


class ApiKeyError(ValueError):
    """The configured key cannot be read (a startup error)."""


def resolve_api_key(server_args: ServerArgs) -> str | None:
    """The key the server requires, or None for an open server."""
    if server_args.api_key:
        return server_args.api_key
    if server_args.api_key_file:
        return _read_key_file(server_args.api_key_file)
    return environ.api_key()


def _read_key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise ApiKeyError(f"--api-key-file {path}: cannot read it ({e.strerror})") from None
    if not key:
        raise ApiKeyError(f"--api-key-file {path}: the first line is empty")
    return key


class ApiKeyMiddleware:
    """Pure ASGI (so streaming and disconnect detection are untouched): every route but
    /health needs `Authorization: Bearer <key>`."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        guarded = scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS
        if guarded and not self.authorized(scope):
            err = RequestError("Invalid or missing API key.", status_code=401)
            response = request_error_response(err, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, scope: dict[str, Any]) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self.expected)
