"""One real uvicorn server for the entrypoint tests, backed by `FakeTokenizerManager`."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn
from fastapi import FastAPI

from srt.entrypoints.http_errors import install_error_handlers
from srt.entrypoints.openai.routes import register_openai_routes
from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager


@pytest.fixture(scope="session")
def session_tm(default_model_path: str) -> FakeTokenizerManager:
    from srt.model_loader.loader import get_tokenizer

    return FakeTokenizerManager(get_tokenizer(default_model_path), default_model_path)


@pytest.fixture
def tm(session_tm: FakeTokenizerManager) -> FakeTokenizerManager:
    session_tm.reset()
    return session_tm


@pytest.fixture(scope="session")
def base_url(session_tm: FakeTokenizerManager) -> Iterator[str]:
    app = FastAPI()
    install_error_handlers(app)
    register_openai_routes(app, session_tm)
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
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as c:
        yield c
