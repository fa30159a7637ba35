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

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.entrypoints.http_errors import json_response
from srt.entrypoints.openai.protocol import ResponsesRequest
from srt.entrypoints.openai.response_store import ResponseStore, StoredResponse
from srt.entrypoints.openai.responses_input import chat_request, input_messages
from srt.entrypoints.openai.responses_output import OutputItems
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
from srt.entrypoints.openai.tool_use import ChoiceReader, ToolUse
from srt.entrypoints.sse import start_sse


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
