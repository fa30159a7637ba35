"""Small HTTP helpers for the entrypoint tests (plain `requests`, no OpenAI client)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
import requests
import uvicorn
from fastapi import FastAPI

from srt.entrypoints.http_errors import install_error_handlers
from srt.entrypoints.openai.routes import register_openai_routes

TIMEOUT_S = 10
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The smallest valid body of each route; field tests add one field to it.
FIELDS_BASE: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Fields"}], "max_tokens": 4},
    COMPLETIONS: {"prompt": "Fields", "max_tokens": 4},
}


@contextlib.contextmanager
def serve_openai_routes(tm: Any, **route_args: Any) -> Iterator[str]:
    """The OpenAI routes over `tm` (a tokenizer-manager test double) on a real uvicorn server
    in a thread; yields its base URL. `route_args`: `register_openai_routes`' options."""
    app = FastAPI()
    install_error_handlers(app)
    register_openai_routes(app, tm, **route_args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held until uvicorn owns it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


def post(url: str, body: dict[str, Any] | bytes) -> requests.Response:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    return requests.post(url, data=data, headers=headers, timeout=TIMEOUT_S)


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    """Every `data:` payload of a streamed response, decoded; "[DONE]" stays a string."""
    with requests.post(url, json=body, stream=True, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/event-stream")
        events: list[Any] = []
        for line in resp.iter_lines():
            if not line or line.startswith(b":"):  # blank, or an SSE comment (keep-alive)
                continue
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: ") :]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    assert events and events[-1] == "[DONE]", events
    return events


def assert_error(resp: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The response is our error shape with `status`; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def without_rid(obj: Any) -> dict[str, Any]:
    """A received request as a dict, less its rid (a fresh response id per request)."""
    out = dataclasses.asdict(obj)
    out.pop("rid")
    return out


def sent_fields(base_url: str, tm: Any, route: str, extra: Mapping[str, Any]) -> Any:
    """POST the route's base body plus `extra`; return the response and what reached `tm`."""
    tm.reset()
    resp = post(base_url + route, {**FIELDS_BASE[route], **extra})
    return resp, list(tm.received)
