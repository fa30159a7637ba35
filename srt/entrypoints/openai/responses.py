"""OpenAI response shapes: plain dataclasses that orjson serializes directly (the request
models are in `protocol.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class PromptTokensDetails:
    cached_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class UsageInfo:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


@dataclass(slots=True, kw_only=True)
class ModelCard:
    id: str
    object: str = "model"
    created: int
    owned_by: str = "radixrt"
    root: str
    max_model_len: int


@dataclass(slots=True, kw_only=True)
class CompletionChoice:
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # SGLang extra: the stop string or stop token id that ended the choice.
    matched_stop: int | str | None = None


@dataclass(slots=True, kw_only=True)
class CompletionResponse:
    """Both the full response and a stream chunk (OpenAI uses one object name for both)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


@dataclass(slots=True, kw_only=True)
class FunctionCallOut:
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True, kw_only=True)
class ToolCallOut:
    """`message.tool_calls[i]`."""

    id: str
    type: str = "function"
    function: FunctionCallOut


@dataclass(slots=True, kw_only=True)
class DeltaToolCall:
    """`delta.tool_calls[i]` of a stream chunk: the first piece of call `index` carries its
    id, type and name; later pieces only argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallOut


@dataclass(slots=True, kw_only=True)
class ChatResponseMessage:
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


@dataclass(slots=True, kw_only=True)
class ChatChoice:
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


@dataclass(slots=True, kw_only=True)
class ChatCompletionResponse:
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


@dataclass(slots=True, kw_only=True)
class DeltaMessage:
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


@dataclass(slots=True, kw_only=True)
class ChatStreamChoice:
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


@dataclass(slots=True, kw_only=True)
class ChatCompletionChunk:
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
