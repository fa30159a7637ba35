"""Every HTTP error in one shape: `{"error": {"message", "type", "param", "code"}}`.

`install_error_handlers(app)` maps `RequestError` (with its headers, e.g. a 503's
`Retry-After`), validation errors, malformed JSON, unknown
routes / methods and unexpected exceptions to that shape, so native and OpenAI routes answer
alike. Streaming routes that fail after their first chunk send `sse_error_event(...)` instead.

Every message is capped at `MAX_ERROR_MESSAGE_CHARS` here, at the edge: a message may quote
what the client sent (a model name, a grammar compiler's view of a schema), and an error
must not echo a large body back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from managers.errors import RequestError

logger = logging.getLogger(__name__)

# Locations FastAPI prefixes to a field path; the field name comes after them.
_REQUEST_PARTS = ("body", "query", "path", "header", "cookie")

MAX_ERROR_MESSAGE_CHARS = 1024
_MAX_PARAM_CHARS = 128


def capped(text: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """`text`, cut to `limit` characters with a note saying how long it was."""
    if len(text) <= limit:
        return text
    note = f" ... [{len(text)} characters, cut]"
    return text[: max(0, limit - len(note))] + note


def _capped_error(err: RequestError) -> RequestError:
    param = None if err.param is None else capped(err.param, _MAX_PARAM_CHARS)
    if len(err.message) <= MAX_ERROR_MESSAGE_CHARS and param == err.param:
        return err
    return RequestError(capped(err.message), param, err.status_code, err.headers)


def json_response(content: Any, status_code: int = 200, headers: Any = None) -> Response:
    return Response(
        orjson.dumps(content), status_code, headers=headers, media_type="application/json"
    )


def request_error_response(err: RequestError, headers: Any = None) -> Response:
    if headers is None:
        headers = err.headers
    return json_response(_capped_error(err).to_json(), err.status_code, headers)


def error_response(message: str, status_code: int = 400, param: str | None = None) -> Response:
    return request_error_response(RequestError(message, param, status_code))


def sse_error_event(message: str, status_code: int = 500, param: str | None = None) -> bytes:
    """One server-sent event carrying the error, for failures after a stream has started."""
    err = _capped_error(RequestError(message, param, status_code))
    return b"data: " + orjson.dumps(err.to_json()) + b"\n\n"


def request_error_from_validation(
    exc: ValidationError | RequestValidationError,
) -> RequestError:
    """A 400 naming the top-level field of the first validation error (an unknown field:
    "Unrecognized request field `tools.0.foo`", param `tools`)."""
    errors = exc.errors()
    if not errors:
        return RequestError("Invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if len(loc) > 1 and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return RequestError(f"Malformed JSON body: {first.get('msg', '')}")
    message = first.get("msg", "invalid value")
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        cause = first["ctx"]["error"]
        if isinstance(cause, RequestError) and not loc:
            return cause  # a whole-body check naming its field itself (openai/fields.py)
        message = str(cause)  # without pydantic's "Value error, " prefix
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return RequestError(f"Unrecognized request field `{where}`", loc[0] if loc else None)
    return RequestError(f"{where}: {message}" if where else message, loc[0] if loc else None)


async def read_json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 `RequestError`."""
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise RequestError(f"Malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object")
    return body


async def _on_request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return request_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, (ValidationError, RequestValidationError))
    return request_error_response(request_error_from_validation(exc))


async def _on_json_error(request: Request, exc: Exception) -> Response:
    return error_response(f"Malformed JSON body: {exc}")


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return request_error_response(RequestError(message, None, exc.status_code), exc.headers)


async def _on_unexpected_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response, so the server logs the traceback.
    logger.error("Unhandled error on %s %s: %r", request.method, request.url.path, exc)
    return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, _on_request_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ValidationError, _on_validation_error)
    # orjson.JSONDecodeError subclasses json.JSONDecodeError.
    app.add_exception_handler(json.JSONDecodeError, _on_json_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected_error)
