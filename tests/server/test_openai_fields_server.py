"""Request-field treatment (`srt/entrypoints/openai/fields.py`) through the real `openai`
client and the shared real server: refusals reach the client as `BadRequestError` naming the
field, accepted no-ops and `best_of: 1` run, and SGLang's `regex` constrains the output."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_unknown_field_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, extra_body={"max_token": 2}
        )
    assert info.value.param == "max_token"
    assert "Unrecognized request field `max_token`" in info.value.message


def test_suffix_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="def f(", suffix="\n    return x", max_tokens=2
        )
    assert info.value.param == "suffix"


def test_best_of_one_and_no_op_fields_are_accepted(client: openai.OpenAI) -> None:
    # SGLang's benchmark client sends best_of 1 with n 1.
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", best_of=1, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=2,
        user="user-1",
        metadata={"team": "tests"},
        store=False,
    )
    assert out.choices[0].finish_reason == "length"


def test_regex_constrains_chat_output(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body={"regex": "(yes|no)"}
    )
    assert out.choices[0].message.content in ("yes", "no")
