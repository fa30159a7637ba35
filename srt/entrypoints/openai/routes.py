"""The OpenAI-compatible routes: `/v1/models`, `/v1/models/{model}`, `/v1/completions`,
`/v1/chat/completions`, `/v1/embeddings`, `/v1/responses` (and `GET /v1/responses/{id}`),
one `APIRouter` that `register_openai_routes` mounts.

Bodies are parsed here with orjson (not by FastAPI) so malformed JSON and invalid fields
answer 400 in our error shape even where `install_error_handlers` is not installed.

A model card names the model as it is served (`--served-model-name`), never its local path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from pydantic import ValidationError

from managers.errors import RequestError
from srt.entrypoints.http_errors import (
    json_response,
    read_json_body,
    request_error_from_validation,
    request_error_response,
)
from srt.entrypoints.openai.response_store import ResponseStore
from srt.entrypoints.openai.responses import ModelCard
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from srt.entrypoints.openai.serving_responses import OpenAIServingResponses
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


@dataclass(frozen=True, slots=True)
class OpenAIHandlers:
    """What the OpenAI routes serve with, kept on `app.state.openai`."""

    tm: TokenizerManagerLike
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding
    responses: OpenAIServingResponses

    def model_card(self) -> ModelCard:
        name = self.tm.served_model_name
        return ModelCard(id=name, created=now(), root=name, max_model_len=self.tm.context_len)


async def get_handlers(request: Request) -> OpenAIHandlers:  # a coroutine: no thread hop
    return request.app.state.openai


HandlersDep = Annotated[OpenAIHandlers, Depends(get_handlers)]

router = APIRouter()


@router.get("/v1/models")
async def list_models(handlers: HandlersDep) -> Response:
    return json_response({"object": "list", "data": [handlers.model_card()]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, handlers: HandlersDep) -> Response:
    try:
        check_model(handlers.tm, model)
    except RequestError as err:
        return request_error_response(err)
    return json_response(handlers.model_card())


@router.post("/v1/completions")
async def create_completion(request: Request, handlers: HandlersDep) -> Response:
    return await _serve(handlers.completions.handle, request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, handlers: HandlersDep) -> Response:
    return await _serve(handlers.chat.handle, request)


@router.post("/v1/embeddings")
async def create_embedding(request: Request, handlers: HandlersDep) -> Response:
    return await _serve(handlers.embeddings.handle, request)


@router.post("/v1/responses")
async def create_response(request: Request, handlers: HandlersDep) -> Response:
    return await _serve(handlers.responses.handle, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, handlers: HandlersDep) -> Response:
    try:
        return handlers.responses.retrieve(response_id)
    except RequestError as err:
        return request_error_response(err)


def register_openai_routes(
    app: FastAPI,
    tm: TokenizerManagerLike,
    max_batch_size: int = ServerArgs.max_batch_size,
    tools: ServerToolConfig | None = None,
    response_store_size: int = ServerArgs.response_store_size,
) -> None:
    """Keep the handlers on `app.state` and mount `router`."""
    # n alone is held to the limit by the tokenizer manager
    chat = OpenAIServingChat(tm, tools)
    app.state.openai = OpenAIHandlers(
        tm,
        OpenAIServingCompletion(tm, max_batch_size),
        chat,
        OpenAIServingEmbedding(tm, max_batch_size),
        OpenAIServingResponses(tm, chat, ResponseStore(response_store_size)),
    )
    app.include_router(router)
