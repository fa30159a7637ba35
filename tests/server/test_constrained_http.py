"""Structured output over HTTP: OpenAI response_format, native json_schema/regex with
streaming, and invalid grammars answered with a 400 while the server stays healthy."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import orjson
import pytest
import requests

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_openai_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0.0, 0.8):
        out = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            max_tokens=96,
            temperature=temperature,
            seed=1,
            response_format=fmt,
        )
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        assert out.choices[0].finish_reason == "stop"


def test_openai_json_object_streaming(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        max_tokens=128,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_native_regex_stream(url: str) -> None:
    body = {
        "text": "Today's date is",
        "sampling_params": {"max_new_tokens": 32, "regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
        "stream": True,
    }
    with requests.post(url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith(b"data: {")]
    final = orjson.loads(lines[-1][len(b"data: ") :])
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", final["text"]), final["text"]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"json_schema": '{"type": "objec'}, "JSON"),
        ({"json_schema": '{"type": "object", "properties": 5}'}, "properties"),
        ({"regex": "a(b"}, "parenthesis"),
        ({"ebnf": 'root ::= "a" | '}, "EBNF"),
    ],
)
def test_invalid_grammar_is_a_400(url: str, params: dict, needle: str) -> None:
    for stream in (False, True):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 8, **params}, "stream": stream}
        r = requests.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert needle.lower() in r.json()["error"]["message"].lower(), r.text
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200


def test_invalid_response_format_schema_is_a_400(url: str) -> None:
    body = {
        "messages": ASK,
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
    }
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
    state = requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["memory_integrity"]["ok"] is not False


@pytest.mark.parametrize("filters", [{"top_p": 0.9}, {"top_k": 5}])
def test_grammar_that_leaves_no_token_aborts_the_request_not_the_server(
    url: str, filters: dict
) -> None:
    """After "a" the regex allows only EOS, which min_new_tokens forbids: no token is left.
    A sampled request with top_p or top_k ends as an abort naming the grammar (the sampler's
    candidate filter must leave it a token to reject), and the server keeps serving."""
    params = {"regex": "a", "min_new_tokens": 3, "max_new_tokens": 5, "temperature": 1.0}
    body = {"text": "Hi", "sampling_params": {**params, **filters}}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    finish = r.json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "grammar" in finish["message"], finish
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200
