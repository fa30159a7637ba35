"""`POST /v1/chat/completions`: messages -> chat template -> token ids -> one
`GenerateReqInput`.

The template is `--chat-template` when given, else the tokenizer's own. Streams start each
choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI does.
"""

from __future__ import annotations

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
from srt.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from srt.entrypoints.openai.serving_utils import (
    TokenizerManagerLike,
    UsageTracker,
    check_model,
    collect_final,
    finish_reason,
    merge_outputs,
    now,
    sampling_params,
    sse_response,
)

# OpenAI's newer name for the system role; most chat templates only know "system".
_ROLE_ALIASES = {"developer": "system"}


class OpenAIServingChat:
    def __init__(self, tm: TokenizerManagerLike) -> None:
        self.tm = tm

    async def handle(self, body: dict[str, Any], raw_request: Request) -> Response:
        req = ChatCompletionRequest.model_validate(body)
        check_model(self.tm, req.model)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        # The template writes its own special tokens (BOS included, where it has one), so the
        # text is tokenized without adding more.
        prompt_ids = await self.tm.off_loop(
            lambda: self.tm.tokenizer.encode(
                self.apply_chat_template(req), add_special_tokens=False
            )
        )
        obj = GenerateReqInput(
            input_ids=prompt_ids,
            sampling_params=sampling_params(req, req.max_new_tokens),
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
            return await sse_response(self._chunks(req, gens, response_id))
        return await self._full_response(req, gens, response_id)

    def apply_chat_template(self, req: ChatCompletionRequest) -> str:
        if self.tm.tokenizer is None:
            raise RequestError("Chat completions need a tokenizer; this server has none.")
        messages = [
            {"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in req.messages
        ]
        try:
            text = self.tm.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                chat_template=self.tm.chat_template,
            )
        except (TemplateError, ValueError, TypeError) as err:  # ValueError: no template
            raise RequestError(f"Cannot apply the chat template: {err}", "messages") from None
        return str(text)

    async def _full_response(
        self,
        req: ChatCompletionRequest,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
    ) -> Response:
        finals = await collect_final(gens, req.n)
        usage = UsageTracker()
        choices = []
        for (_, index), out in sorted(finals.items()):
            meta = out["meta_info"]
            usage.update(0, index, meta)
            reason, matched = finish_reason(out)
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(self.tm.tokenizer, take(meta, "output"))
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=out["text"]),
                    logprobs=logprobs,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        response = ChatCompletionResponse(
            id=response_id,
            created=now(),
            model=self.tm.served_model_name,
            choices=choices,
            usage=usage.usage(),
        )
        return json_response(response)

    async def _chunks(
        self,
        req: ChatCompletionRequest,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = now()
        usage = UsageTracker()
        sent_chars: dict[int, int] = {}  # output characters already sent, per choice
        sent_logprobs: dict[int, int] = {}  # output logprob entries already sent

        def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created, model=self.tm.served_model_name, choices=[choice]
            )

        async with aclosing(merge_outputs(gens)) as outputs:
            async for _, out in outputs:
                index = out.get("index", 0)
                meta = out["meta_info"]
                usage.update(0, index, meta)
                reason, matched = finish_reason(out)
                if index not in sent_chars:
                    sent_chars[index] = 0
                    role = DeltaMessage(role="assistant", content="")
                    yield chunk(ChatStreamChoice(index=index, delta=role))
                delta = out["text"][sent_chars[index] :]
                sent_chars[index] = max(sent_chars[index], len(out["text"]))
                logprobs = None
                if req.logprobs:
                    lps = take(meta, "output", sent_logprobs.get(index, 0))
                    sent_logprobs[index] = sent_logprobs.get(index, 0) + len(lps)
                    logprobs = chat_logprobs(self.tm.tokenizer, lps)
                if not delta and reason is None and not (logprobs and logprobs["content"]):
                    continue
                yield chunk(
                    ChatStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=delta or None),
                        logprobs=logprobs,
                        finish_reason=reason,
                        matched_stop=matched,
                    )
                )
        if req.include_usage:
            yield ChatCompletionChunk(
                id=response_id,
                created=created,
                model=self.tm.served_model_name,
                choices=[],
                usage=usage.usage(),
            )
