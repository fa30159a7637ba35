"""The HTTP server: SGLang's native routes, the operations routes and the OpenAI-compatible
ones, over one `TokenizerManager`.

`create_app(tm, server_args)` builds the FastAPI app (tests serve it too); `serve.py` runs it.
The routes live by concern: `native_routes.py` (generate, abort, flush),
`tokenize_routes.py` (tokenize, detokenize, tokenizer info), `admin_routes.py` (health, load,
model and server info, metrics) and `openai/routes.py`; they reach the `TokenizerManager` and `ServerArgs` through `app_state.py`.

Limits that keep one client from stalling the others: a body over `--max-request-bytes` is
refused (413) before it is read whole (`limits.py`); prompts are tokenized off the event loop
(see `TokenizerManager`); the API key is checked by `auth.py`.
"""

from __future__ import annotations

from fastapi import FastAPI

from managers.tokenizer_manager import TokenizerManager
from srt.entrypoints import admin_routes, native_routes, tokenize_routes
from srt.entrypoints.admin_routes import VERSION
from srt.entrypoints.app_state import install_state
from srt.entrypoints.auth import ApiKeyMiddleware, resolve_api_key
from srt.entrypoints.http_errors import install_error_handlers
from srt.entrypoints.limits import BodyLimitMiddleware
from srt.entrypoints.openai.routes import register_openai_routes
from srt.entrypoints.openai.tool_use import ServerToolConfig
from srt.entrypoints.openapi_bodies import describe_request_bodies
from srt.server_args import ServerArgs

__all__ = ["VERSION", "create_app"]


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    app = FastAPI(title="RadixRT", version=VERSION)
    install_error_handlers(app)
    api_key = resolve_api_key(server_args)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # Behind an API key every reader is an operator: show where the model was loaded from.
    install_state(app, tm, server_args, show_local_paths=api_key is not None)
    app.include_router(admin_routes.router)
    app.include_router(native_routes.router)
    app.include_router(tokenize_routes.router)
    if server_args.enable_metrics:
        app.include_router(admin_routes.metrics_router)
    tools = ServerToolConfig(server_args.tool_call_parser, server_args.reasoning_parser)
    register_openai_routes(
        app, tm, server_args.max_batch_size, tools, server_args.response_store_size
    )
    describe_request_bodies(app)
    # Added last, so outermost: an oversized body is refused before the key is checked.
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    return app
