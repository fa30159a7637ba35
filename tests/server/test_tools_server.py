"""Tools and reasoning with the official `openai` client against the shared real server
(default model, `--chat-template smollm2-tools --tool-call-parser hermes --reasoning-parser
qwen3`, see tests/conftest.py).

The 135M model does not choose to call tools on its own, so the free-text paths (tool_choice
auto, reasoning) are driven by a `regex` constraint that makes it write the marked-up text a
larger model would; `required` and a named function are forced by the server's own grammar.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _tool(k: int) -> dict[str, Any]:
    """Tool k of 20, each with its own parameters; bounded strings and numbers keep a forced
    call short whatever the model writes."""
    props: dict[str, Any] = {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detailed": {"type": "boolean"},
    }
    names = list(props)[: 1 + k % 4]
    return {
        "type": "function",
        "function": {
            "name": f"tool_{k}",
            "description": f"Tool number {k}: weather facts ({', '.join(names)})",
            "parameters": {
                "type": "object",
                "properties": {n: props[n] for n in names},
                "required": names[: 1 + k % 2],
                "additionalProperties": False,
            },
        },
    }


TOOLS = [_tool(k) for k in range(20)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _streamed(chunks: Any) -> tuple[str, str, list[dict[str, str]], str | None]:
    """(content, reasoning, calls, finish_reason) rebuilt from a stream as a client would;
    asserts the first piece of each call carries its id, type and name."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_validates(
    client: openai.OpenAI, temperature: float, stream: bool
) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": temperature,
        "seed": 7,
        "max_tokens": 200,
    }
    if stream:
        content, _, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
        assert content == ""
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.message.content is None
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        assert all(
            c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls
        )
        finish = choice.finish_reason
    assert finish == "tool_calls" and calls
    for call in calls:
        _check_call(call["name"], call["arguments"])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_named_tool_call_streamed_equals_full(client: openai.OpenAI, temperature: float) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "tool_3"}},
        "temperature": temperature,
        "seed": 11,
        "max_tokens": 200,
    }
    full = client.chat.completions.create(**kw).choices[0]
    [call] = full.message.tool_calls
    assert call.function.name == "tool_3" and full.finish_reason == "tool_calls"
    _check_call("tool_3", call.function.arguments)
    content, _, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert calls == [{"name": "tool_3", "arguments": call.function.arguments}]


def test_parallel_tool_calls_false_gives_one_call_per_choice(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS[:3],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=3,
        n=2,
        max_tokens=200,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        [call] = choice.message.tool_calls
        _check_call(call.function.name, call.function.arguments)


def test_tool_choice_none_never_calls(client: openai.OpenAI) -> None:
    # Even text that looks like a call stays content: nothing is parsed under "none".
    looks_like_a_call = (
        '<tool_call>\n{"name": "tool_0", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for extra in ({}, {"regex": _escape(looks_like_a_call)}):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="none",
            temperature=0,
            max_tokens=60,
            extra_body=extra,
        )
        choice = out.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"
        assert choice.message.content
    assert choice.message.content == looks_like_a_call


def _escape(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_and_text_around_them(client: openai.OpenAI, stream: bool) -> None:
    call = '{"name": "tool_1", "arguments": {"city": "Paris", "unit": "celsius"}}'
    text = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 80,
        "extra_body": {"regex": _escape(text)},
    }
    expected = [{"name": "tool_1", "arguments": '{"city": "Paris", "unit": "celsius"}'}]
    if stream:
        content, _, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ]
    assert content.strip() == "Let me check."
    assert (calls, finish) == (expected, "tool_calls")


def test_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    """The usual client loop: the assistant message object goes back as it came (the client
    serializes the fields the server sent), then the tool's result."""
    named = {"type": "function", "function": {"name": "tool_0"}}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=40
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}
    out = client.chat.completions.create(
        model=MODEL, messages=[*ASK, message, result], tools=TOOLS, temperature=0, max_tokens=12
    )
    choice = out.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    # The call and its result are in the prompt: it is longer than the question alone.
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_off(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 30,
        "extra_body": {"regex": "<think>x</think>y"},
    }
    if stream:
        content, reasoning, _, _ = _streamed(client.chat.completions.create(**kw, stream=True))
    else:
        message = client.chat.completions.create(**kw).choices[0].message
        content, reasoning = message.content, message.reasoning_content
    assert (reasoning, content) == ("x", "y")
    kw["extra_body"] = {**kw["extra_body"], "separate_reasoning": False}
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.content == "<think>x</think>y" and message.reasoning_content is None


def _deep_tool(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "function", "function": {"name": "deep", "parameters": schema}}


def test_bad_tool_requests_name_their_field(client: openai.OpenAI) -> None:
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{**TOOLS[0], "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        # A forced choice's grammar is held to the grammar limits like any other, and the
        # refusal names the field it came from (nesting over --grammar-max-depth 20).
        ({"tools": [_deep_tool(25)], "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
