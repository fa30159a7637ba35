"""`POST /v1/completions`: one `GenerateReqInput` per prompt, run concurrently.

Choice indices are prompt-major: sample j of prompt i is choice `i * n + j`. Prompts times n
may not exceed `--max-batch-size`, the limit `/generate` shares.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

from fastapi import Request, Response

from managers.io_struct import GenerateReqInput
from managers.validation import check_batch_size, check_token_ids
from srt.entrypoints.http_errors import json_response
from srt.entrypoints.openai.logprobs import completion_logprobs, take
from srt.entrypoints.openai.protocol import CompletionRequest, PromptField
from srt.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from srt.entrypoints.openai.serving_utils import (
    TokenizerManagerLike,
    UsageTracker,
    collect_final,
    finish_reason,
    json_schema_source,
    merge_outputs,
    now,
    response_model,
    sampling_params,
    sse_response,
)

Prompt = str | list[int]


def split_prompts(prompt: PromptField) -> list[Prompt]:
    """A single prompt (text or token ids) or a batch of them, as a list of prompts."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [cast(Prompt, prompt)]
    return cast(list[Prompt], list(prompt))


class OpenAIServingCompletion:
    def __init__(self, tm: TokenizerManagerLike, max_batch_size: int) -> None:
        self.tm = tm
        self.max_batch_size = max_batch_size

    async def handle(self, body: dict[str, Any], raw_request: Request) -> Response:
        req = CompletionRequest.model_validate(body)
        prompts = split_prompts(req.prompt)
        check_batch_size(len(prompts), len(prompts) * req.n, self.max_batch_size, "prompt")
        params = sampling_params(req, req.max_tokens)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        gens = [
            self.tm.generate_request(
                self._request_input(req, prompt, params, response_id, i, len(prompts)),
                raw_request,
            )
            for i, prompt in enumerate(prompts)
        ]
        prompt_texts = [self._prompt_text(p) for p in prompts] if req.echo else []
        if req.stream:
            chunks = self._chunks(req, gens, response_id, prompt_texts)
            return await sse_response(chunks, json_schema_source(req))
        return await self._full_response(req, gens, response_id, prompt_texts)

    def _request_input(
        self,
        req: CompletionRequest,
        prompt: Prompt,
        params: dict[str, Any],
        response_id: str,
        i: int,
        num_prompts: int,
    ) -> GenerateReqInput:
        want_logprobs = req.logprobs is not None
        return GenerateReqInput(
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else list(prompt),
            sampling_params=dict(params),
            rid=response_id if num_prompts == 1 else f"{response_id}-{i}",
            stream=req.stream,
            return_logprob=want_logprobs,
            logprob_start_len=0 if want_logprobs and req.echo else -1,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=want_logprobs,
            bootstrap=req.bootstrap(),
            timeout=req.timeout,
            priority=req.priority,
        )

    def _prompt_text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        # Checked before decoding (the request itself is checked later): the tokenizer
        # raises OverflowError on an id past 2**32.
        check_token_ids(prompt, self.tm.vocab_size)
        return str(self.tm.tokenizer.decode(prompt))

    async def _full_response(
        self,
        req: CompletionRequest,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
        prompt_texts: list[str],
    ) -> Response:
        finals = await collect_final(gens, req.n, json_schema_source(req))
        usage = UsageTracker()
        choices = []
        for (i, j), out in sorted(finals.items()):
            index = i * req.n + j
            meta = out["meta_info"]
            usage.update(i, index, meta)
            reason, matched = finish_reason(out)
            text = prompt_texts[i] + out["text"] if req.echo else out["text"]
            logprobs = None
            if req.logprobs is not None:
                lps = take(meta, "output")
                if req.echo:
                    lps = take(meta, "input") + lps
                logprobs = completion_logprobs(self.tm.tokenizer, lps, 0)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        response = CompletionResponse(
            id=response_id,
            created=now(),
            model=response_model(self.tm, req.model),
            choices=choices,
            usage=usage.usage(),
        )
        return json_response(response)

    async def _chunks(
        self,
        req: CompletionRequest,
        gens: list[AsyncGenerator[dict[str, Any], None]],
        response_id: str,
        prompt_texts: list[str],
    ) -> AsyncGenerator[CompletionResponse, None]:
        created = now()
        model = response_model(self.tm, req.model)
        usage = UsageTracker()
        sent_chars: dict[int, int] = {}  # output characters already sent, per choice
        sent_logprobs: dict[int, int] = {}  # output logprob entries already sent
        next_offset: dict[int, int] = {}  # text_offset of the next token, per choice
        async with aclosing(merge_outputs(gens)) as outputs:
            async for i, out in outputs:
                index = i * req.n + out.get("index", 0)
                meta = out["meta_info"]
                usage.update(i, index, meta)
                reason, matched = finish_reason(out)
                first = index not in sent_chars
                done_chars = sent_chars.get(index, 0)
                delta = out["text"][done_chars:]
                sent_chars[index] = max(done_chars, len(out["text"]))
                if first and req.echo:
                    delta = prompt_texts[i] + delta
                logprobs = None
                if req.logprobs is not None:
                    lps = take(meta, "output", sent_logprobs.get(index, 0))
                    sent_logprobs[index] = sent_logprobs.get(index, 0) + len(lps)
                    if first and req.echo:
                        lps = take(meta, "input") + lps
                    offset = next_offset.get(index, 0)
                    logprobs = completion_logprobs(self.tm.tokenizer, lps, offset)
                    next_offset[index] = offset + sum(len(t) for t in logprobs["tokens"])
                if not delta and reason is None and not (logprobs and logprobs["tokens"]):
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=delta,
                    logprobs=logprobs,
                    finish_reason=reason,
                    matched_stop=matched,
                )
                yield CompletionResponse(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=usage.choice_usage(i, index) if req.usage_per_chunk else None,
                )
        if req.include_usage:
            yield CompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage.usage(),
            )
