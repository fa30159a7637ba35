"""logit_bias against the shared real server: chat, completions and native /generate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BANANA = 21285  # " banana", one token in SmolLM2's vocabulary (49152 ids)
PROMPT = "The capital of France is"
BOOST = {str(BANANA): 100}


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def generate(url: str, prompt: str = PROMPT, max_new_tokens: int = 8, **params: Any) -> list[int]:
    """Greedy output ids of native /generate."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params},
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_native_boost_forces_the_token(url: str) -> None:
    assert generate(url, logit_bias=BOOST, ignore_eos=True) == [BANANA] * 8


def test_completions_boost_forces_the_token(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=BOOST, logprobs=1
    )
    choice = out.choices[0]
    assert choice.logprobs.tokens == [" banana"] * 8 and out.usage.completion_tokens == 8
    # The returned logprobs include the bias: +100 makes the forced token near-certain.
    assert all(lp > -1e-3 for lp in choice.logprobs.token_logprobs)


def test_chat_stream_boost_forces_the_token(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a city."}],
            max_tokens=8,
            temperature=0,
            logit_bias=BOOST,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == ["banana"] * 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_minus_100_bans_the_greedy_token(url: str, client: openai.OpenAI) -> None:
    first = generate(url)[0]
    banned = generate(url, logit_bias={str(first): -100})
    assert len(banned) == 8 and first not in banned
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**kw, logprobs=1).choices[0].logprobs.tokens
    again = client.completions.create(**kw, logprobs=1, logit_bias={str(first): -100})
    assert plain[0] not in again.choices[0].logprobs.tokens


BAD = [
    ("/v1/chat/completions", {"x": 1}),
    ("/v1/chat/completions", {str(BANANA): 101}),
    ("/v1/completions", {"49152": 1}),  # out of the vocabulary: refused by verify()
    ("/v1/completions", {"-3": 1}),
    ("/generate", {"abc": 1}),
    ("/generate", {"49152": 1}),
    ("/generate", {str(BANANA): -101}),
]


@pytest.mark.parametrize(("route", "bias"), BAD)
def test_bad_logit_bias_is_a_400_naming_it(url: str, route: str, bias: dict[str, Any]) -> None:
    if route == "/generate":
        body: dict[str, Any] = {"text": "a", "sampling_params": {"logit_bias": bias}}
    else:
        body = {"model": MODEL, "max_tokens": 2, "logit_bias": bias}
        if route == "/v1/completions":
            body["prompt"] = "a"
        else:
            body["messages"] = [{"role": "user", "content": "a"}]
    r = requests.post(url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == "logit_bias" and "logit_bias" in err["message"], err


def test_no_leak_into_a_concurrent_unbiased_request(url: str) -> None:
    prompt = "Once upon a time, there was a"
    alone = generate(url, prompt, 16)
    with ThreadPoolExecutor(4) as pool:
        biased = [
            pool.submit(generate, url, prompt, 16, logit_bias={**BOOST, str(alone[0]): -100})
            for _ in range(3)
        ]
        plain = pool.submit(generate, url, prompt, 16)
        assert plain.result() == alone
        assert all(f.result()[0] == BANANA for f in biased)
