"""A Responses API request as a chat request: `input` items become chat messages
(`input_messages`), tools, tool choice and text format the chat request's (`chat_request`).
Items and fields the chat machinery cannot honour are refused by name."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from managers.errors import RequestError
from srt.entrypoints.http_errors import request_error_from_validation
from srt.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest

# Keys an input item of each type may carry besides `type`; others are refused. `id` and
# `status` come back with items a client copies from an earlier output.
_ITEM_KEYS = {
    "message": {"role", "content", "id", "status"},
    "function_call": {"call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"call_id", "output", "id", "status"},
    "reasoning": {"id", "summary", "content", "encrypted_content", "status"},
}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_ROLES = {"user", "assistant", "system", "developer"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# Chat request fields -> the Responses field a validation error names.
_PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to; errors name the Responses fields."""
    messages = list(conversation)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    optional = {
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "response_format": chat_response_format(req.text),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        error = request_error_from_validation(err)
        error.param = _PARAM_NAMES.get(error.param or "", error.param)
        raise error from None


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(
                f"tools[{i}]: tools of type {kind!r} are not supported; only function tools are",
                "tools",
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise RequestError(f"tools[{i}]: unrecognized field `{unknown[0]}`", "tools")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise RequestError(f"text: unrecognized field `{unknown[0]}`", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError("text.verbosity: not supported (only medium)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format: a json_schema format needs a `schema` object", "text")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format: type {kind!r} is not supported", "text")


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages. Consecutive function calls (and a message just before them)
    make one assistant message; a reasoning item becomes the next assistant message's
    `reasoning_content`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind not in _ITEM_KEYS:
            raise RequestError(
                f"{where}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output and reasoning are)",
                "input",
            )
        unknown = sorted(set(item) - _ITEM_KEYS[kind] - {"type"})
        if unknown:
            raise RequestError(f"{where}: unrecognized field `{unknown[0]}`", "input")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"{where}: role must be one of {sorted(_ROLES)}", "input")
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), where),
                }
            )
        else:
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = _text(parts, where) if parts else None
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}: `{key}` must be a string", "input")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or a list of text parts joined with newlines (as chat content parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(
                f"{where}: content parts of type {kind!r} are not supported: this server "
                "serves a text-only model",
                "input",
            )
        unknown = sorted(set(part) - _PART_KEYS)
        if unknown or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: a text part has `type` and a string `text`", "input")
        texts.append(part["text"])
    return "\n".join(texts)
