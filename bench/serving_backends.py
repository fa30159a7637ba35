"""How each backend is asked and how its stream is read: native `/generate` (cumulative SSE
events) and the OpenAI routes (deltas, usage last). `send_request` times one streamed request;
any failure becomes `error` on its result, never an exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.datasets import DatasetRow, encode

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
# Native events repeat the whole output so far: allow long SSE lines.
READ_BUFSIZE = 1 << 22
MAX_ERRORS_KEPT = 10  # distinct error messages kept in the summary


@dataclass(slots=True)
class StreamState:
    """What the events of one response have said so far."""

    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    cached_tokens: int = 0
    text: str = ""


def native_payload(row: DatasetRow, model: str | None) -> dict[str, Any]:
    key = "text" if isinstance(row.prompt, str) else "input_ids"
    params = {"max_new_tokens": row.output_len, "temperature": 0, "ignore_eos": True}
    return {key: row.prompt, "sampling_params": params, "stream": True}


def openai_payload(row: DatasetRow, model: str | None, chat: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": row.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": row.prompt}]
    else:
        body["prompt"] = row.prompt
    return body


def native_event(event: dict[str, Any], st: StreamState) -> int:
    """Absorb one cumulative native event; return how many new tokens it carried."""
    meta = event.get("meta_info") or {}
    before = st.completion_tokens or 0
    count = meta.get("completion_tokens")
    if count is None and event.get("output_ids") is not None:
        count = len(event["output_ids"])
    text = event.get("text", st.text)
    if count is None:  # no counts at all: a chunk with new text is one token
        count = before + (text != st.text)
    st.text, st.completion_tokens = text, count
    st.prompt_tokens = meta.get("prompt_tokens", st.prompt_tokens)
    st.cached_tokens = meta.get("cached_tokens", st.cached_tokens)
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        st.error = f"aborted: {reason.get('message', '')}"
    return count - before


def openai_event(event: dict[str, Any], st: StreamState) -> int:
    """Absorb one OpenAI chunk (completion or chat); a chunk with text is one token."""
    usage = event.get("usage") or {}
    if usage:
        st.completion_tokens = usage.get("completion_tokens", st.completion_tokens)
        st.prompt_tokens = usage.get("prompt_tokens", st.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        st.cached_tokens = details.get("cached_tokens") or st.cached_tokens
    delta = ""
    for choice in event.get("choices") or []:
        delta += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    st.text += delta
    return 1 if delta else 0


@dataclass(frozen=True, slots=True)
class Backend:
    path: str
    payload: Callable[[DatasetRow, str | None], dict[str, Any]]
    on_event: Callable[[dict[str, Any], StreamState], int]


NATIVE = Backend("/generate", native_payload, native_event)
BACKENDS = {
    "radixrt": NATIVE,
    "sglang": NATIVE,
    "openai": Backend("/v1/completions", openai_payload, openai_event),
    "vllm": Backend("/v1/completions", openai_payload, openai_event),
    "openai-chat": Backend(
        "/v1/chat/completions", lambda r, m: openai_payload(r, m, chat=True), openai_event
    ),
}


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payloads of the `data:` lines of an SSE response, as bytes (parsed by orjson: a
    native stream's events are cumulative, so at ~1000 tokens each is kilobytes, and the
    standard library's parser made the client the slowest process of a run)."""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


def error_text(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


async def send_request(
    session: aiohttp.ClientSession,
    backend: Backend,
    url: str,
    row: DatasetRow,
    model: str | None,
    tokenizer: Any = None,
) -> RequestResult:
    """One streamed request, timed; any failure becomes `error` on the result."""
    result, st = RequestResult(prompt_len=row.prompt_len), StreamState()
    start = last = time.perf_counter()
    first = True
    try:
        async with session.post(url, json=backend.payload(row, model)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            done = False
            async for data in sse_data(resp):
                if data == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                new = backend.on_event(event, st)
                if event.get("error") or st.error:
                    result.error = st.error or error_text(event["error"])
                    return result
                if new > 0:
                    now = time.perf_counter()
                    if first:
                        result.ttft, first = now - start, False
                    else:
                        result.itl.extend([(now - last) / new] * new)
                    last = now
            if not done:
                result.error = "stream ended before [DONE]"
                return result
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.text, result.cached_tokens = st.text, st.cached_tokens
    if st.prompt_tokens is not None:
        result.prompt_len = st.prompt_tokens
    if st.completion_tokens is not None:
        result.output_len = st.completion_tokens
    elif tokenizer is not None:
        result.output_len = len(encode(tokenizer, st.text))
    else:
        result.output_len = len(result.itl) + (not first)
    result.success = True
    return result
