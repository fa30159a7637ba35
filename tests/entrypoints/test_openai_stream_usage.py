"""`stream_options.continuous_usage_stats` (vLLM's meaning, as load generators send it) and
the `model` field (any name is served and echoed), against `FakeTokenizerManager`."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.entrypoints.fake_tokenizer_manager import CACHED_TOKENS, FakeTokenizerManager
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error, post, sse_events

PER_CHUNK = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES = [{"role": "user", "content": "Count"}]


def _index(chunk: dict[str, Any]) -> int:
    return int(chunk["choices"][0]["index"])


def _check_per_choice(chunks: list[dict[str, Any]], full: dict[str, Any]) -> None:
    """Each choice's chunks carry its usage so far: its prompt's tokens, its own completion
    tokens (never falling), their sum; the last one ends at the choice's final count."""
    assert all(c["usage"] is not None for c in chunks)
    for choice in full["choices"]:
        own = [c["usage"] for c in chunks if _index(c) == choice["index"]]
        completions = [u["completion_tokens"] for u in own]
        assert completions == sorted(completions) and completions[-1] == 6, completions
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in own)
        assert len({u["prompt_tokens"] for u in own}) == 1


def test_completions_usage_on_every_chunk(base_url: str, tm: FakeTokenizerManager) -> None:
    url = base_url + COMPLETIONS
    body = {"prompt": ["One two", "Three four five six"], "max_tokens": 6, "n": 2}
    full = post(url, body).json()
    chunks = sse_events(url, {**body, "stream": True, "stream_options": PER_CHUNK})[:-1]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert {_index(c) for c in chunks} == {0, 1, 2, 3}
    _check_per_choice(chunks, full)
    # Prompt-major choices: 0 and 1 belong to the first prompt, 2 and 3 to the second.
    lengths = [len(tm.tokenizer.encode(p)) for p in body["prompt"]]
    for c in chunks:
        assert c["usage"]["prompt_tokens"] == lengths[_index(c) // 2]
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED_TOKENS
    assert sum(lengths) == full["usage"]["prompt_tokens"]


def test_chat_usage_on_every_chunk(base_url: str, tm: FakeTokenizerManager) -> None:
    url = base_url + CHAT
    body = {"messages": MESSAGES, "max_tokens": 6, "n": 2}
    full = post(url, body).json()
    chunks = sse_events(url, {**body, "stream": True, "stream_options": PER_CHUNK})[:-1]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    _check_per_choice(chunks, full)
    for index in (0, 1):
        own = [c for c in chunks if _index(c) == index]
        assert own[0]["choices"][0]["delta"]["role"] == "assistant"
        assert own[0]["usage"]["completion_tokens"] == 0  # the role chunk: no token yet
        assert own[0]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("options", "final_usage"),
    [
        ({"include_usage": True}, True),  # the final usage chunk only
        ({"continuous_usage_stats": True}, False),  # without include_usage: nothing (vLLM)
        ({"include_usage": False, "continuous_usage_stats": True}, False),
    ],
)
def test_usage_only_where_asked(
    base_url: str, route: str, options: dict[str, bool], final_usage: bool
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, "stream": True, "stream_options": options}
    body.update({"messages": MESSAGES} if route == CHAT else {"prompt": "Count"})
    chunks = sse_events(base_url + route, body)[:-1]
    assert all(c["usage"] is None for c in chunks if c["choices"])
    assert (chunks[-1]["choices"] == []) == final_usage


def test_continuous_usage_stats_type_checked(base_url: str) -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}
    assert_error(post(base_url + COMPLETIONS, body), 400, "stream_options")


def test_openai_client_reads_usage_per_chunk(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake-model", prompt="Count", max_tokens=4, stream=True, stream_options=PER_CHUNK
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks) and counts[-2:] == [4, 4]  # last choice chunk, the total


def test_any_model_name_is_served_and_echoed(client: openai.OpenAI, base_url: str) -> None:
    """SGLang's rule: the one loaded model serves whatever name a request carries, and the
    response echoes it (sglang-router's PD mode forwards "unknown"; clients default to a hosted
    model's name); no name: the served name."""
    for name in ("gpt-4o", "unknown"):
        messages: Any = MESSAGES
        out = client.chat.completions.create(model=name, messages=messages, max_tokens=2)
        assert out.model == name
        stream = client.completions.create(model=name, prompt="x", max_tokens=2, stream=True)
        assert {c.model for c in stream} == {name}
    assert post(base_url + COMPLETIONS, {"prompt": "x", "max_tokens": 1}).json()["model"] == (
        "fake-model"
    )
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    # A model card is only the served model's, as on SGLang.
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # The name is echoed in every chunk: an absurd one is refused, not copied.
    error = assert_error(post(base_url + COMPLETIONS, {"prompt": "x", "model": "m" * 5000}), 400)
    assert error["param"] == "model" and len(error["message"]) < 200
