"""Mounts the OpenAI-compatible routes on the server's FastAPI app.

Bodies are parsed here with orjson (not by FastAPI) so malformed JSON and invalid fields
answer 400 in our error shape even where `install_error_handlers` is not installed.

A model card names the model as it is served (`--served-model-name`), never its local path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from managers.errors import RequestError
from srt.entrypoints.http_errors import (
    json_response,
    read_json_body,
    request_error_from_validation,
    request_error_response,
)
from srt.entrypoints.openai.protocol import ModelCard
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.entrypoints.openai.serving_utils import TokenizerManagerLike, check_model, now
from srt.entrypoints.openai.tool_use import ServerToolConfig
from srt.server_args import ServerArgs

Handler = Callable[[dict[str, Any], Request], Awaitable[Response]]


async def _serve(handler: Handler, request: Request) -> Response:
    try:
        return await handler(await read_json_body(request), request)
    except RequestError as err:
        return request_error_response(err)
    except ValidationError as err:
        return request_error_response(request_error_from_validation(err))


def register_openai_routes(
    app: FastAPI,
    tm: TokenizerManagerLike,
    max_batch_size: int = ServerArgs.max_batch_size,
    tools: ServerToolConfig | None = None,
) -> None:
    completions = OpenAIServingCompletion(tm, max_batch_size)
    # n alone is held to the limit by the tokenizer manager
    chat = OpenAIServingChat(tm, tools)

    def model_card() -> ModelCard:
        name = tm.served_model_name
        return ModelCard(id=name, created=now(), root=name, max_model_len=tm.context_len)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        try:
            check_model(tm, model)
        except RequestError as err:
            return request_error_response(err)
        return json_response(model_card())

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await _serve(completions.handle, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await _serve(chat.handle, request)
