"""`FakeStreamingServer`: a double of an inference server, so the benchmark client is tested
alone. It streams native and OpenAI SSE with scripted delays, chosen by the prompt text."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Script:
    """How the server answers one prompt: tokens per chunk, and when each chunk is sent."""

    chunks: list[int] = field(default_factory=lambda: [1, 1, 1])
    first_delay: float = 0.0
    gap: float = 0.0
    prompt_tokens: int = 10
    cached_tokens: int = 0
    fail: str | None = None  # "http", "event" or "drop"
    report_counts: bool = True  # native meta_info counts / OpenAI usage


class FakeStreamingServer:
    """aiohttp app on a free port in a thread. `scripts` maps a prompt to its `Script`;
    `log` records ("flush",) and ("request", prompt) in arrival order."""

    def __init__(
        self, scripts: dict[str, Script] | None = None, tokenizer_path: str | None = None
    ) -> None:
        self.scripts = scripts or {}
        self.tokenizer_path = tokenizer_path
        self.log: list[tuple[str, ...]] = []
        self.in_flight = self.peak_in_flight = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeStreamingServer:  # noqa: PYI034
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/flush_cache", self.flush_cache)
        self.runner = web.AppRunner(app)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), self.loop).result(10)
        return self

    async def start(self) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def model_info(self, request: web.Request) -> web.Response:
        info = {"model_path": self.tokenizer_path, "tokenizer_path": self.tokenizer_path}
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.log.append(("flush",))
        return web.Response(text="ok")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("text", json.dumps(body.get("input_ids")))
        return await self.stream(request, prompt, native=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        chat = "messages" in body
        if body.get("stream_options", {}).get("include_usage") is not True:
            return web.json_response({"error": "bench must ask for usage"}, status=400)
        return await self.stream(request, prompt, native=False, chat=chat)

    async def stream(
        self, request: web.Request, prompt: str, native: bool, chat: bool = False
    ) -> web.StreamResponse:
        script = self.scripts.get(prompt, Script())
        self.log.append(("request", prompt))
        if script.fail == "http":
            return web.json_response({"error": {"message": "scripted 503"}}, status=503)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await self.send_chunks(request, resp, script, native, chat)
            return resp
        finally:
            self.in_flight -= 1

    async def send_chunks(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        script: Script,
        native: bool,
        chat: bool,
    ) -> None:
        total = 0
        for i, k in enumerate(script.chunks):
            await asyncio.sleep(script.first_delay if i == 0 else script.gap)
            if i == 1 and script.fail == "event":
                await send(resp, {"error": {"message": "scripted failure", "code": 500}})
                break
            if i == 1 and script.fail == "drop":
                assert request.transport is not None
                request.transport.abort()
                return
            total += k
            last = i == len(script.chunks) - 1
            if native:
                await send(resp, native_event(script, total, last))
            else:
                piece = "tok " * k
                choice: dict[str, Any] = (
                    {"index": 0, "delta": {"content": piece}}
                    if chat
                    else {"index": 0, "text": piece}
                )
                await send(resp, {"choices": [choice]})
        else:
            if not native and script.report_counts:
                await send(resp, {"choices": [], "usage": usage(script, total)})
        await resp.write(b"data: [DONE]\n\n")


async def send(resp: web.StreamResponse, item: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(item).encode() + b"\n\n")


def native_event(script: Script, total: int, last: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": {"type": "length"} if last else None}
    if script.report_counts:
        meta.update(
            prompt_tokens=script.prompt_tokens,
            completion_tokens=total,
            cached_tokens=script.cached_tokens,
        )
    return {"text": "tok " * total, "output_ids": list(range(total)), "meta_info": meta}


def usage(script: Script, total: int) -> dict[str, Any]:
    return {
        "prompt_tokens": script.prompt_tokens,
        "completion_tokens": total,
        "total_tokens": script.prompt_tokens + total,
        "prompt_tokens_details": {"cached_tokens": script.cached_tokens},
    }
