"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API on the chat
machinery.

A request becomes chat messages: `instructions` as a system message, then the stored
conversation of `previous_response_id` (`response_store.py`), then the `input` items
(`input_messages`). Its tools, tool choice and text format become the chat request's, so the
chat template renders it and `ToolUse` decides what is forced, parsed and separated exactly as
on `/v1/chat/completions`. The one `ChoiceReader` of the output feeds `OutputItems`, which
turns its pieces into output items (a reasoning item, a message, function calls, in the order
the model wrote them) and, streaming, into the Responses event sequence; a full response is
the same items read in one piece, so a stream and a full response carry the same output.

Streams start (`response.created`, `response.in_progress`) only when the first output is
there, so a request refused before it began is a plain 4xx, as on the other routes; a failure
after that is an `error` event. Leaving a stream early aborts the request (its KV is freed).
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson
from fastapi import Request, Response
from pydantic import ValidationError

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.entrypoints.http_errors import json_response, request_error_from_validation
from srt.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from srt.entrypoints.openai.response_store import ResponseStore, StoredResponse
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_utils import (
    TokenizerManagerLike,
    collect_final,
    finish_reason,
    name_grammar_field,
    now,
    response_model,
    sampling_params,
)
from srt.entrypoints.openai.tool_use import ChoicePiece, ChoiceReader, ToolUse, new_call_id
from srt.entrypoints.sse import start_sse
from srt.function_call.core import ToolCallDelta

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


class OpenAIServingResponses:
    def __init__(
        self, tm: TokenizerManagerLike, chat: OpenAIServingChat, store: ResponseStore
    ) -> None:
        self.tm = tm
        self.chat = chat
        self.store = store

    def retrieve(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry is None:
            raise RequestError(self.store.not_found(response_id), "response_id", 404)
        return json_response(entry.response)

    async def handle(self, body: dict[str, Any], raw_request: Request) -> Response:
        req = ResponsesRequest.model_validate(body)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id)
            if entry is None:
                message = self.store.not_found(req.previous_response_id)
                raise RequestError(message, "previous_response_id", 404)
            history = entry.conversation
        conversation = history + input_messages(req.input)
        chat_req = chat_request(req, conversation)
        tool_use = ToolUse.from_request(chat_req, self.chat.server)
        prompt_ids = await self.tm.off_loop(
            lambda: self.tm.tokenizer.encode(
                self.chat.apply_chat_template(chat_req, tool_use), add_special_tokens=False
            )
        )
        params = sampling_params(chat_req, chat_req.max_new_tokens)
        tool_use.apply(params, req.parallel_tool_calls)
        turn = Turn(self, req, conversation, tool_use.reader())
        obj = GenerateReqInput(
            input_ids=prompt_ids, sampling_params=params, rid=turn.id, stream=req.stream
        )
        gen = self.tm.generate_request(obj, raw_request)
        # A grammar refusal names the field that built the grammar.
        schema_source = "tools" if tool_use.forced else "text"
        if req.stream:
            return await start_sse(turn.events(gen, schema_source))
        finals = await collect_final([gen], 1, schema_source)
        out = finals[(0, 0)]
        reason, _ = finish_reason(out)  # raises for a refused or failed request
        turn.items.feed(out["text"])
        return json_response(turn.finish(reason, out["meta_info"]))


class Turn:
    """One response in the making: its output items, its response object, and what the store
    keeps of it."""

    def __init__(
        self,
        serving: OpenAIServingResponses,
        req: ResponsesRequest,
        conversation: list[dict[str, Any]],
        reader: ChoiceReader,
    ) -> None:
        self.serving = serving
        self.req = req
        self.conversation = conversation
        self.items = OutputItems(reader)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = now()
        self.model = response_model(serving.tm, req.model)

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": copy.deepcopy(self.items.items),
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": req.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_logprobs": 0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }

    def finish(self, reason: str | None, meta: dict[str, Any]) -> dict[str, Any]:
        """Close the items; the final response object, kept in the store if asked."""
        status = {"length": "incomplete", "abort": "failed"}.get(reason or "", "completed")
        self.items.finish("incomplete" if status == "incomplete" else "completed")
        response = self.response(status, self._usage(meta))
        if status == "failed":
            message = "The request was aborted before it finished."
            response["error"] = {"code": "server_error", "message": message}
        elif self.req.store:
            turn = self.conversation + [self.items.assistant_message()]
            self.serving.store.put(self.id, StoredResponse(turn, response))
        return response

    def _usage(self, meta: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
        reasoning = self.items.reasoning_text()
        tokenizer = self.serving.tm.tokenizer
        reasoning_tokens = (
            len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
            "total_tokens": prompt + completion,
        }

    async def events(
        self, gen: AsyncGenerator[dict[str, Any], None], schema_source: str
    ) -> AsyncGenerator[bytes, None]:
        """The Responses event sequence of a stream (see the module docstring)."""
        sequence = itertools.count()

        def event(fields: dict[str, Any]) -> bytes:
            fields["sequence_number"] = next(sequence)
            kind = fields["type"].encode()
            return b"event: " + kind + b"\ndata: " + orjson.dumps(fields) + b"\n\n"

        started, sent, reason, meta = False, 0, None, {}
        try:
            async with aclosing(gen):
                async for out in gen:
                    reason, _ = finish_reason(out)
                    meta = out["meta_info"]
                    if not started:
                        started = True
                        response = self.response("in_progress")
                        yield event({"type": "response.created", "response": response})
                        yield event({"type": "response.in_progress", "response": response})
                    self.items.feed(out["text"][sent:])
                    sent = max(sent, len(out["text"]))
                    for fields in self.items.take_events():
                        yield event(fields)
        except RequestError as err:
            name_grammar_field(err, schema_source)
            if not started:
                raise
            yield event(
                {
                    "type": "error",
                    "code": str(err.status_code),
                    "message": err.message,
                    "param": err.param,
                }
            )
            return
        response = self.finish(reason, meta)
        for fields in self.items.take_events():
            yield event(fields)
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
        kind = terminal.get(response["status"], "response.failed")
        yield event({"type": kind, "response": response})


class OutputItems:
    """A response's output items, built from one `ChoiceReader`'s pieces, with the stream
    events that build them (`take_events`). Text opens a message (reasoning a reasoning item)
    or continues the open one; a call's first piece closes what is open and opens a
    function call; `finish` closes everything."""

    def __init__(self, reader: ChoiceReader) -> None:
        self.reader = reader
        self.items: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the open reasoning or message item
        self._calls: dict[int, int] = {}  # call index -> its item's index, while open

    def feed(self, text: str) -> None:
        if text:
            self._apply(self.reader.feed(text))

    def finish(self, status: str) -> None:
        self._apply(self.reader.finish())
        if not self.items:
            self._text("message", "")  # a response always says something, if only ""
        self._close_text(status)
        self._close_calls(status)

    def take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def reasoning_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a next turn's template renders."""
        text = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [item for item in self.items if item["type"] == "function_call"]
        if calls:
            message["tool_calls"] = [
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
                for call in calls
            ]
        if reasoning := self.reasoning_text():
            message["reasoning_content"] = reasoning
        return message

    def _apply(self, piece: ChoicePiece) -> None:
        if piece.reasoning:
            self._text("reasoning", piece.reasoning)
        if piece.content:
            self._text("message", piece.content)
        for delta in piece.calls:
            self._call(delta)

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append({"type": kind, **fields})

    def _where(self, index: int) -> dict[str, Any]:
        """Where a text event belongs: the item, its place in the output, its one part."""
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        return index

    def _text(self, kind: str, delta: str) -> None:
        index = self._open
        if index is None or self.items[index]["type"] != kind:
            self._close_text("completed")
            self._close_calls("completed")
            if kind == "message":
                item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []}
                part = {"type": "reasoning_text", "text": ""}
            index = self._open = self._add({**item, "status": "in_progress", "content": []})
            self.items[index]["content"].append(part)
            if kind == "message":
                self._emit("response.content_part.added", **self._where(index), part=dict(part))
        item = self.items[index]
        item["content"][0]["text"] += delta
        if not delta:
            return
        where = self._where(index)
        if kind == "message":
            self._emit("response.output_text.delta", **where, delta=delta, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=delta)

    def _close_text(self, status: str) -> None:
        index, self._open = self._open, None
        if index is None:
            return
        item = self.items[index]
        part = item["content"][0]
        where = self._where(index)
        if item["type"] == "message":
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, part=dict(part))
        else:
            self._emit("response.reasoning_text.done", **where, text=part["text"])
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _call(self, delta: ToolCallDelta) -> None:
        index = self._calls.get(delta.index)
        if index is None:
            self._close_text("completed")
            self._close_calls("completed")
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": new_call_id(),
                "name": delta.name or "",
                "arguments": "",
                "status": "in_progress",
            }
            index = self._calls[delta.index] = self._add(item)
        item = self.items[index]
        if delta.name and not item["name"]:
            item["name"] = delta.name
        if delta.arguments:
            item["arguments"] += delta.arguments
            self._emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=delta.arguments,
            )

    def _close_calls(self, status: str) -> None:
        for index in sorted(self._calls.values()):
            item = self.items[index]
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            item["status"] = status
            self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        self._calls.clear()


# ---- request -> chat ---------------------------------------------------------------------


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
