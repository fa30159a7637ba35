"""The HTTP server: SGLang's native routes plus the OpenAI-compatible ones, over one
`TokenizerManager`.

`create_app(tm, server_args)` builds the FastAPI app (tests serve it too); `serve.py` runs it.

Limits that keep one client from stalling the others: a body over `--max-request-bytes` is
refused (413) before it is read whole (`limits.py`); prompts are tokenized off the event loop
(see `TokenizerManager`); the API key is checked by `auth.py`. Clients see the served model
name, never the model's local path; `/get_server_info` shows local paths only when an API
key guards it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request, Response

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from managers.tokenizer_manager import TokenizerManager, combined_memory_integrity
from srt.entrypoints.auth import ApiKeyMiddleware, resolve_api_key
from srt.entrypoints.http_errors import (
    install_error_handlers,
    json_response,
    read_json_body,
    sse_error_event,
)
from srt.entrypoints.limits import BodyLimitMiddleware
from srt.entrypoints.native_protocol import generate_all, parse_generate, stream_all
from srt.entrypoints.openai.routes import register_openai_routes
from srt.entrypoints.openai.tool_use import ServerToolConfig
from srt.entrypoints.sse import SSE_DONE, sse_event, start_sse
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Server arguments that are local paths: shown by /get_server_info only behind an API key.
LOCAL_PATH_ARGS = ("model_path", "tokenizer_path", "chat_template", "cache_dir", "api_key_file")


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


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    app = FastAPI(title="RadixRT", version=VERSION)
    install_error_handlers(app)
    if api_key := resolve_api_key(server_args):
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        """200 while the server can serve: 503 once it shuts down or a child died, and while
        the scheduler is silent for longer than one step may take (`--watchdog-timeout`)."""
        tm.ensure_started()  # the scheduler's heartbeats are read from here on
        if tm.dead_reason is not None or tm.scheduler_stalled() is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_load")
    async def get_load() -> Response:
        """SGLang's shape, which sglang-router's load monitor (power_of_two) reads."""
        tm.ensure_started()
        return json_response(tm.load())

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
        )

        async def one() -> None:
            async for _ in tm.generate_request(obj):
                pass

        try:
            await asyncio.wait_for(one(), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RequestError) as e:
            logger.error("health_generate failed: %r", e)
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info() -> Response:
        name = tm.served_model_name  # the local paths stay private (see the module docstring)
        return json_response(
            {
                "model_path": name,
                "tokenizer_path": name,
                "served_model_name": name,
                "is_generation": True,
                "context_length": tm.context_len,
            }
        )

    # Behind an API key every reader is an operator: show where the model was loaded from.
    show_local_paths = resolve_api_key(server_args) is not None

    async def server_info() -> Response:
        states = await tm.get_internal_states()
        args = dataclasses.asdict(server_args)
        args.pop("api_key", None)
        # What the scheduler runs with where the field's default depends on the device.
        args["max_prefill_tokens"] = server_args.prefill_token_budget()
        args["disable_overlap_schedule"] = not server_args.overlap_schedule()
        if show_local_paths:
            args["model_path"] = tm.model_path
        else:
            args.update(dict.fromkeys(LOCAL_PATH_ARGS))
            args["model_path"] = tm.served_model_name
        return json_response(
            {
                **args,
                "version": VERSION,
                "served_model_name": tm.served_model_name,
                "max_total_num_tokens": tm.max_total_tokens,
                "internal_states": [dataclasses.asdict(state) for state in states],
                "memory_integrity": dataclasses.asdict(combined_memory_integrity(states)),
            }
        )

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json_body(request)
        objs, is_batch = parse_generate(body, server_args.max_batch_size)
        if not objs[0].stream:
            return json_response(await generate_all(tm, objs, is_batch, request))
        # Errors before the first output are plain 4xx / 503, unless it is queued for long.
        return await start_sse(sse_stream(stream_all(tm, objs, is_batch, request)))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        return Response(out.message, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json_body(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise RequestError("`rid` must be a string and `abort_all` a boolean.", "rid")
        if not rid and not abort_all:
            raise RequestError("Give `rid` or `abort_all: true`.", param="rid")
        tm.abort_request(rid, abort_all)
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_json_body(request)
        prompt = body.get("prompt", body.get("text"))
        add_special = body.get("add_special_tokens", True)
        if tm.tokenizer is None:
            raise RequestError("This server has no tokenizer.", status_code=400)
        texts = prompt if isinstance(prompt, list) else [prompt]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("`prompt` must be a string or a list of strings.", "prompt")
        if not isinstance(add_special, bool):
            raise RequestError("`add_special_tokens` must be a boolean.", "add_special_tokens")
        ids = await tm.off_loop(
            lambda: [tm.tokenizer.encode(t, add_special_tokens=add_special) for t in texts]
        )
        one = not isinstance(prompt, list)
        return json_response(
            {
                "tokens": ids[0] if one else ids,
                "count": len(ids[0]) if one else [len(x) for x in ids],
                "max_model_len": tm.context_len,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_json_body(request)
        tokens = body.get("tokens")
        skip = body.get("skip_special_tokens", False)
        if tm.tokenizer is None:
            raise RequestError("This server has no tokenizer.", status_code=400)
        batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        seqs = tokens if batch else [tokens]

        def decode() -> list[str] | None:
            ok = isinstance(tokens, list) and all(
                isinstance(s, list)
                and all(isinstance(t, int) and 0 <= t < tm.vocab_size for t in s)
                for s in seqs
            )
            return [tm.tokenizer.decode(s, skip_special_tokens=skip) for s in seqs] if ok else None

        if not isinstance(skip, bool):
            raise RequestError("`skip_special_tokens` must be a boolean.", "skip_special_tokens")
        texts = await tm.off_loop(decode)
        if texts is None:
            raise RequestError(
                f"`tokens` must be a list of token ids in [0, {tm.vocab_size}).", "tokens"
            )
        return json_response({"text": texts if batch else texts[0]})

    if server_args.enable_metrics:

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4")

    tools = ServerToolConfig(server_args.tool_call_parser, server_args.reasoning_parser)
    register_openai_routes(app, tm, server_args.max_batch_size, tools)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    return app
