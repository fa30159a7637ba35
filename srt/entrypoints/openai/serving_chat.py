"""`POST /v1/chat/completions`: messages (and tools) -> chat template -> token ids -> one
`GenerateReqInput`; its outputs -> reasoning, content and tool calls.

The template is `--chat-template` when given, else the tokenizer's own. What `tools`,
`tool_choice` and the reasoning parser change is decided in `tool_use.py`; each choice's
output is read by one `ChoiceReader`, delta by delta when streaming, so a stream and a full
response carry the same calls. Streams start each choice with a
`{"role": "assistant", "content": ""}` delta, as OpenAI does; a call streams as a first
`delta.tool_calls` entry with its id and name, then argument fragments.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request, Response
from jinja2 import TemplateError

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.entrypoints.http_errors import json_response
from srt.entrypoints.openai.logprobs import chat_logprobs, take
from srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from srt.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCallOut,
    ToolCallOut,
)
from srt.entrypoints.openai.serving_utils import (
    TokenizerManagerLike,
    UsageTracker,
    collect_final,
    finish_reason,
    merge_outputs,
    now,
    response_model,
    sampling_params,
    sse_response,
)
from srt.entrypoints.openai.tool_use import (
    ChoiceReader,
    ServerToolConfig,
    ToolUse,
    new_call_id,
    template_kwargs,
)
from srt.function_call.core import join_calls

logger = logging.getLogger(__name__)

# OpenAI's newer name for the system role; most chat templates only know "system".
_ROLE_ALIASES = {"developer": "system"}


class OpenAIServingChat:
    def __init__(self, tm: TokenizerManagerLike, server: ServerToolConfig | None = None) -> None:
        self.tm = tm
        self.server = server or ServerToolConfig()
        template = tm.chat_template or getattr(tm.tokenizer, "chat_template", None)
        if self.server.tool_call_parser and isinstance(template, str) and "tools" not in template:
            logger.warning(
                "--tool-call-parser %s is set, but the chat template never renders `tools`: "
                "the model will not see the tools of tool_choice auto (the default model has "
                "one that does: --chat-template smollm2-tools)",
                self.server.tool_call_parser,
            )

    async def handle(self, body: dict[str, Any], raw_request: Request) -> Response:
        req = ChatCompletionRequest.model_validate(body)
        tool_use = ToolUse.from_request(req, self.server)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        # The template writes its own special tokens (BOS included, where it has one), so the
        # text is tokenized without adding more.
        prompt_ids = await self.tm.off_loop(
            lambda: self.tm.tokenizer.encode(
                self.apply_chat_template(req, tool_use), add_special_tokens=False
            )
        )
        params = sampling_params(req, req.max_new_tokens)
        tool_use.apply(params, req.parallel_tool_calls)
        obj = GenerateReqInput(
            input_ids=prompt_ids,
            sampling_params=params,
            rid=response_id,
            stream=req.stream,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=req.logprobs,
            bootstrap=req.bootstrap(),
            timeout=req.timeout,
            priority=req.priority,
        )
        gens = [self.tm.generate_request(obj, raw_request)]
        if req.stream:
            chunks = self._chunks(req, tool_use, gens, response_id)
            return await sse_response(chunks, tool_use.schema_source(req))
        return await self._full_response(req, tool_use, gens, response_id)

    def apply_chat_template(self, req: ChatCompletionRequest, tool_use: ToolUse) -> str:
        if self.tm.tokenizer is None:
            raise RequestError("Chat completions need a tokenizer; this server has none.")
        messages = [_template_message(m) for m in req.messages]
        kwargs = template_kwargs(req)
        if tool_use.template_tools is not None:
            kwargs["tools"] = tool_use.template_tools
        try:
            text = self.tm.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                chat_template=self.tm.chat_template,
                **kwargs,
            )
        except (TemplateError, ValueError, TypeError) as err:  # ValueError: no template
            raise RequestError(f"Cannot apply the chat template: {err}", "messages") from None
        return str(text)

    async def _full_response(
        self,
        req: ChatCompletionRequest,
        tool_use: ToolUse,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
    ) -> Response:
        finals = await collect_final(gens, req.n, tool_use.schema_source(req))
        usage = UsageTracker()
        choices = []
        for (_, index), out in sorted(finals.items()):
            meta = out["meta_info"]
            usage.update(0, index, meta)
            reason, matched = finish_reason(out)
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(self.tm.tokenizer, take(meta, "output"))
            reader = tool_use.reader()
            piece = reader.feed(out["text"])
            piece.extend(reader.finish())
            calls = [
                ToolCallOut(
                    id=new_call_id(),
                    function=FunctionCallOut(name=call.name, arguments=call.arguments),
                )
                for call in join_calls(piece.calls)
            ]
            message = ChatResponseMessage(
                content=piece.content if piece.content or not calls else None,
                reasoning_content=piece.reasoning or None,
                tool_calls=calls or None,
            )
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls and reason == "stop" else reason,
                    matched_stop=matched,
                )
            )
        response = ChatCompletionResponse(
            id=response_id,
            created=now(),
            model=response_model(self.tm, req.model),
            choices=choices,
            usage=usage.usage(),
        )
        return json_response(response)

    async def _chunks(
        self,
        req: ChatCompletionRequest,
        tool_use: ToolUse,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = now()
        model = response_model(self.tm, req.model)
        usage = UsageTracker()
        sent_chars: dict[int, int] = {}  # output characters already sent, per choice
        readers: dict[int, ChoiceReader] = {}
        sent_logprobs: dict[int, int] = {}  # output logprob entries already sent

        def chunk(choice: ChatStreamChoice, tokens: bool = True) -> ChatCompletionChunk:
            """`tokens`: False for the role chunk, sent before the choice's tokens (its usage
            counts none of them, as vLLM's does)."""
            return ChatCompletionChunk(
                id=response_id,
                created=created,
                model=model,
                choices=[choice],
                usage=(
                    usage.choice_usage(0, choice.index if tokens else None)
                    if req.usage_per_chunk
                    else None
                ),
            )

        async with aclosing(merge_outputs(gens)) as outputs:
            async for _, out in outputs:
                index = out.get("index", 0)
                meta = out["meta_info"]
                usage.update(0, index, meta)
                reason, matched = finish_reason(out)
                if index not in sent_chars:
                    sent_chars[index] = 0
                    readers[index] = tool_use.reader()
                    role = DeltaMessage(role="assistant", content="")
                    yield chunk(ChatStreamChoice(index=index, delta=role), tokens=False)
                reader = readers[index]
                piece = reader.feed(out["text"][sent_chars[index] :])
                sent_chars[index] = max(sent_chars[index], len(out["text"]))
                if reason is not None:
                    piece.extend(reader.finish())
                    if reader.call_ids or piece.calls:
                        reason = "tool_calls" if reason == "stop" else reason
                logprobs = None
                if req.logprobs:
                    lps = take(meta, "output", sent_logprobs.get(index, 0))
                    sent_logprobs[index] = sent_logprobs.get(index, 0) + len(lps)
                    logprobs = chat_logprobs(self.tm.tokenizer, lps)
                empty = not (piece.content or piece.reasoning or piece.calls)
                if empty and reason is None and not (logprobs and logprobs["content"]):
                    continue
                delta = DeltaMessage(
                    content=piece.content or None,
                    reasoning_content=piece.reasoning or None,
                    tool_calls=reader.call_outs(piece.calls) or None,
                )
                yield chunk(
                    ChatStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=reason,
                        matched_stop=matched,
                    )
                )
        if req.include_usage:
            yield ChatCompletionChunk(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage.usage(),
            )


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template sees it. A call's arguments go in as a dict
    when they are a JSON object, as templates expect (`arguments | tojson`)."""
    if m.tool_calls and m.role != "assistant":
        raise RequestError("only assistant messages may carry tool_calls", "messages")
    if m.role == "tool" and m.tool_call_id is None:
        raise RequestError("a tool message needs the tool_call_id it answers", "messages")
    message: dict[str, Any] = {"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        message["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in m.tool_calls
        ]
    return message


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text
