"""One real uvicorn server for the entrypoint tests, backed by `FakeTokenizerManager`."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager
from tests.entrypoints.helpers import serve_openai_routes


@pytest.fixture(scope="session")
def session_tm(default_model_path: str) -> FakeTokenizerManager:
    from srt.model_loader.sources import get_tokenizer

    return FakeTokenizerManager(get_tokenizer(default_model_path), default_model_path)


@pytest.fixture
def tm(session_tm: FakeTokenizerManager) -> FakeTokenizerManager:
    session_tm.reset()
    return session_tm


@pytest.fixture(scope="session")
def base_url(session_tm: FakeTokenizerManager) -> Iterator[str]:
    with serve_openai_routes(session_tm) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as c:
        yield c
