"""SGLang's native API: `/generate`, `/encode` (an embedding server), `/abort_request`,
`/flush_cache` (the tokenizer routes are in `tokenize_routes.py`).

Handlers reach the `TokenizerManager` and `ServerArgs` through `app_state` dependencies.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request, Response

from managers.errors import RequestError
from srt.entrypoints.app_state import ServerArgsDep, TokenizerManagerDep
from srt.entrypoints.http_errors import json_response, read_json_body, sse_error_event
from srt.entrypoints.native_protocol import (
    generate_all,
    parse_encode,
    parse_generate,
    stream_all,
)
from srt.entrypoints.sse import NATIVE_KEEPALIVE, SSE_DONE, sse_event, start_sse

router = APIRouter()


async def sse_stream(items: AsyncGenerator[Any, None]) -> AsyncGenerator[bytes, None]:
    """Native streaming: each cumulative output as one event, then [DONE]. A refusal before
    the first event raises (`start_sse` answers it with a plain error when it can); an abort
    or a failure after it becomes an error event."""
    started = False
    async with contextlib.aclosing(items):
        try:
            async for item in items:
                reason = item["meta_info"].get("finish_reason") or {}
                if reason.get("type") == "abort" and reason.get("status_code"):
                    # Refused or failed (not a user's abort): an error event, as OpenAI does.
                    yield sse_error_event(reason["message"], reason["status_code"])
                    break
                started = True
                yield sse_event(item)
        except RequestError as e:
            if not started:
                raise
            yield sse_error_event(e.message, e.status_code, e.param)
    yield SSE_DONE


@router.post("/generate")
async def generate(
    request: Request, tm: TokenizerManagerDep, server_args: ServerArgsDep
) -> Response:
    body = await read_json_body(request)
    objs, is_batch = parse_generate(body, server_args.max_batch_size)
    if not objs[0].stream:
        return json_response(await generate_all(tm, objs, is_batch, request))
    # Errors before the first output are plain 4xx / 503, unless it is queued for long; a
    # long-queued stream gets blank lines, which SGLang's clients skip (sse.py).
    events = sse_stream(stream_all(tm, objs, is_batch, request))
    return await start_sse(events, NATIVE_KEEPALIVE)


@router.post("/encode")
async def encode(request: Request, tm: TokenizerManagerDep, server_args: ServerArgsDep) -> Response:
    """SGLang's native embedding request: `{"embedding": [...], "meta_info": {...}}`, a list
    for a batch."""
    body = await read_json_body(request)
    objs, is_batch = parse_encode(body, server_args.max_batch_size)
    return json_response(await generate_all(tm, objs, is_batch, request))


# One route per method: a route of two methods gives both the same OpenAPI operation id.
@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(tm: TokenizerManagerDep) -> Response:
    out = await tm.flush_cache()
    return Response(out.message, status_code=200 if out.success else 400)


@router.post("/abort_request")
async def abort_request(request: Request, tm: TokenizerManagerDep) -> Response:
    body = await read_json_body(request)
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise RequestError("`rid` must be a string and `abort_all` a boolean.", "rid")
    if not rid and not abort_all:
        raise RequestError("Give `rid` or `abort_all: true`.", param="rid")
    tm.abort_request(rid, abort_all)
    return Response(status_code=200)
