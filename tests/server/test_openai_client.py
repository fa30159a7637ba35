"""The official `openai` Python client against a real server."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_completion(client: openai.OpenAI, url: str) -> None:
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.text.startswith(" Paris") and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == 13


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "1, 2, 3,",
        "max_tokens": 10,
        "temperature": 0,
    }
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=16, temperature=0
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert out.choices[0].finish_reason == "stop"


def test_chat_stream(client: openai.OpenAI) -> None:
    kw = {
        "model": "SmolLM2-135M-Instruct",
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_and_seed(client: openai.OpenAI) -> None:
    kw = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Write a word."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 2,
        "seed": 3,
    }
    out = client.chat.completions.create(**kw)
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]
    assert out.usage.completion_tokens <= 16  # both samples, at most 8 tokens each
    single = client.chat.completions.create(**{**kw, "n": 1})
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the top-1
    comp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    kw = {"model": "SmolLM2-135M-Instruct", "prompt": "Count: 1, 2, 3, 4, 5,", "temperature": 0}
    free = client.completions.create(**kw, max_tokens=16).choices[0].text
    assert " 8" in free
    out = client.completions.create(**kw, max_tokens=16, stop=[" 8", "zzz"]).choices[0]
    assert out.text == free[: free.index(" 8")] and out.finish_reason == "stop"


def test_cached_tokens_on_repeated_long_prompt(client: openai.OpenAI) -> None:
    prompt = "You are a careful assistant. " * 40 + "Question: what is two plus two?"
    kw = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    client.completions.create(**kw)
    second = client.completions.create(**kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0.9 * second.usage.prompt_tokens


def test_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hello there", max_tokens=3, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith("Hello there")


def test_errors_through_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
