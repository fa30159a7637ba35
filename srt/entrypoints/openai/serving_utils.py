"""What completions and chat share: the tokenizer-manager contract, request -> sampling
params, merged output streams, usage accounting and the SSE response.

Every generator from `generate_request` is closed on every path (`aclosing`): closing it is
how a finished-early or disconnected request gets aborted in the scheduler.

Aborts, as SGLang's OpenAI layer reports them: an abort that is neither the client's fault
nor a server failure (an operator's `/abort_request`, a request the KV pool cannot hold to
its end) is a normal choice with the text so far and `finish_reason: "abort"`; an abort
whose finish reason carries a status code (a refusal, 4xx, or a server failure, 5xx) is an
error response, or an error event once a stream has started, as on `/generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request, Response

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.entrypoints.http_errors import sse_error_event
from srt.entrypoints.openai.protocol import ResponseFormat, SamplingRequest
from srt.entrypoints.openai.responses import PromptTokensDetails, UsageInfo
from srt.entrypoints.sse import SSE_DONE, sse_event, start_sse

logger = logging.getLogger(__name__)


T = TypeVar("T")


class TokenizerManagerLike(Protocol):
    """The part of the TokenizerManager the OpenAI layer uses."""

    tokenizer: Any
    served_model_name: str
    model_path: str
    context_len: int
    vocab_size: int
    chat_template: str | None

    def generate_request(
        self, obj: GenerateReqInput, request: Request | None = None
    ) -> AsyncGenerator[dict[str, Any], None]: ...

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run tokenizer work off the event loop (a large prompt must not stall it)."""
        ...


def now() -> int:
    return int(time.time())


def response_model(tm: TokenizerManagerLike, model: str | None) -> str:
    """The `model` of a response: the name the request carried, as SGLang echoes it (the one
    loaded model serves any name), else the served name (where SGLang writes "default")."""
    return model or tm.served_model_name


def check_model(tm: TokenizerManagerLike, model: str) -> None:
    """`GET /v1/models/{model}` knows only the served model (SGLang's 404 too), though a
    completion serves any name."""
    if model not in (tm.served_model_name, tm.model_path):
        raise RequestError(f"The model `{model}` does not exist.", "model", 404)


def apply_response_format(fmt: ResponseFormat | None, params: dict[str, Any]) -> None:
    """The one place `response_format` becomes sampling params (a JSON-schema grammar)."""
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        params["json_schema"] = json.dumps({"type": "object"})
        return
    if fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, dict):
            raise RequestError(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        try:
            params["json_schema"] = json.dumps(schema)
        except RecursionError:
            raise RequestError(
                "response_format.json_schema.schema is nested too deeply", "response_format"
            ) from None
        return
    raise RequestError(
        f"response_format type {fmt.type!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


def json_schema_source(req: SamplingRequest) -> str:
    """The request field a `json_schema` sampling parameter came from (the chat route passes
    "tools" instead when a forced tool choice built it)."""
    return "json_schema" if getattr(req, "json_schema", None) is not None else "response_format"


def name_grammar_field(err: RequestError, source: str) -> RequestError:
    """A refusal of the grammar names the field the client sent: the `json_schema` sampling
    parameter comes from `source` (`json_schema_source`)."""
    if err.param == "json_schema":
        err.param = source
    return err


def sampling_params(req: SamplingRequest, max_new_tokens: int | None) -> dict[str, Any]:
    """SGLang-native sampling params; unset optional fields keep the server defaults."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "n": req.n,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
    }
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "stop_regex": req.stop_regex,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    # One grammar at most, as on /generate: response_format (unless text) or SGLang's
    # regex / ebnf / json_schema. A second one is refused by name rather than one winning.
    sglang = {name: getattr(req, name) for name in ("regex", "ebnf", "json_schema")}
    grammars = [name for name, value in sglang.items() if value is not None]
    if req.response_format is not None and req.response_format.type != "text":
        grammars.insert(0, "response_format")
    if len(grammars) > 1:
        raise RequestError(
            "At most one of response_format (json_object or json_schema), regex, ebnf and "
            f"json_schema may constrain the output; got {', '.join(grammars)}",
            grammars[1],
        )
    apply_response_format(req.response_format, params)
    params.update({name: value for name, value in sglang.items() if value is not None})
    return params


def finish_reason(out: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """(OpenAI finish_reason, matched stop) of one output; raises on an abort that carries a
    status code (refused or failed), while a plain abort is the finish reason "abort"."""
    reason = out["meta_info"].get("finish_reason")
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "abort" and reason.get("status_code"):
        message = reason.get("message") or "The request was aborted"
        raise RequestError(message, None, reason["status_code"])
    if kind == "stop":
        return "stop", reason.get("matched")
    return str(kind), None


@dataclass(slots=True)
class UsageTracker:
    """Token counts of the latest output per choice; each prompt's tokens count once."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)

    def update(self, prompt_index: int, choice_index: int, meta: dict[str, Any]) -> None:
        self.prompt_tokens[prompt_index] = meta.get("prompt_tokens", 0)
        cached = max(self.cached_tokens.get(prompt_index, 0), meta.get("cached_tokens", 0))
        self.cached_tokens[prompt_index] = cached
        self.completion_tokens[choice_index] = meta.get("completion_tokens", 0)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return _usage(prompt, completion, sum(self.cached_tokens.values()))

    def choice_usage(self, prompt_index: int, choice_index: int | None) -> UsageInfo:
        """One choice's usage so far, as vLLM puts it on each chunk with continuous usage
        stats: its prompt's tokens and the choice's own completion tokens (`None`: a chunk
        before its first token, as the chat role chunk)."""
        prompt = self.prompt_tokens.get(prompt_index, 0)
        completion = 0 if choice_index is None else self.completion_tokens.get(choice_index, 0)
        return _usage(prompt, completion, self.cached_tokens.get(prompt_index, 0))


def _usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def merge_outputs(
    gens: list[AsyncGenerator[dict[str, Any], None]],
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """(prompt index, output) from all generators as they arrive; closes all of them on exit."""
    async with contextlib.AsyncExitStack() as stack:
        for gen in gens:
            await stack.enter_async_context(contextlib.aclosing(gen))
        if len(gens) == 1:
            async for out in gens[0]:
                yield 0, out
            return
        pending = {asyncio.ensure_future(anext(gen)): i for i, gen in enumerate(gens)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
                    yield i, out
        finally:
            # A generator cannot be closed while a task is inside it: cancel first.
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


async def collect_final(
    gens: list[AsyncGenerator[dict[str, Any], None]], n: int, schema_source: str
) -> dict[tuple[int, int], dict[str, Any]]:
    """Non-streaming: the final output of every (prompt index, sample index). A grammar
    refusal names `schema_source` (see `name_grammar_field`)."""
    finals: dict[tuple[int, int], dict[str, Any]] = {}
    try:
        async with contextlib.aclosing(merge_outputs(gens)) as outputs:
            async for i, out in outputs:
                finals[(i, out.get("index", 0))] = out
    except RequestError as err:
        name_grammar_field(err, schema_source)
        raise
    if len(finals) != len(gens) * n:
        raise RequestError(f"expected {len(gens) * n} outputs, got {len(finals)}", None, 500)
    return finals


async def _sse(
    chunks: AsyncGenerator[Any, None], schema_source: str
) -> AsyncGenerator[bytes, None]:
    started = False
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                started = True
                yield sse_event(chunk)
        except RequestError as err:
            name_grammar_field(err, schema_source)
            if not started:
                raise
            yield sse_error_event(err.message, err.status_code, err.param)
        except Exception as err:
            if not started:
                raise
            logger.exception("Stream failed after its first chunk")
            yield sse_error_event(f"Internal server error: {type(err).__name__}: {err}")
    yield SSE_DONE


async def sse_response(chunks: AsyncGenerator[Any, None], schema_source: str) -> Response:
    """SSE of `chunks`; an error before the first chunk is a plain JSON error response, unless
    the request is still queued after `FIRST_EVENT_WAIT_S` (see `srt/entrypoints/sse.py`)."""
    return await start_sse(_sse(chunks, schema_source))
