"""The chat route's tool and reasoning decisions, without a model: `ToolUse.from_request`,
the template it renders, the sampling params it adds and how `ChoiceReader` splits an output.
(The same paths against a real server: tests/server/test_tools_server.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from managers.errors import RequestError
from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.tool_use import ServerToolConfig, ToolUse
from srt.function_call.core import join_calls
from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = ServerToolConfig(tool_call_parser="hermes", reasoning_parser="qwen3")


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def refusal(body: dict[str, Any], server: ServerToolConfig = HERMES) -> RequestError:
    with pytest.raises(RequestError) as err:
        ToolUse.from_request(request(**body), server)
    assert err.value.status_code == 400
    return err.value


def test_tool_choice_decisions() -> None:
    auto = ToolUse.from_request(request(tools=[WEATHER]), HERMES)
    assert auto.parser == "hermes" and not auto.forced and auto.template_tools
    none = ToolUse.from_request(request(tools=[WEATHER], tool_choice="none"), HERMES)
    assert none.template_tools is None and none.parser is None and not none.forced
    required = ToolUse.from_request(request(tools=[WEATHER], tool_choice="required"), HERMES)
    assert required.forced and required.named is None and required.reasoning is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    by_name = ToolUse.from_request(request(tools=[WEATHER], tool_choice=named), HERMES)
    assert by_name.forced and by_name.named == "get_weather"
    # required and named need no parser; auto does.
    assert ToolUse.from_request(
        request(tools=[WEATHER], tool_choice="required"), ServerToolConfig()
    )
    assert refusal({"tools": [WEATHER]}, ServerToolConfig()).param == "tools"
    assert refusal({"tools": [WEATHER], "tool_choice": "auto"}, ServerToolConfig()).param == (
        "tool_choice"
    )


def test_bad_tool_requests() -> None:
    assert refusal({"tool_choice": "required"}).param == "tool_choice"
    other = {"type": "function", "function": {"name": "other"}}
    assert refusal({"tools": [WEATHER], "tool_choice": other}).param == "tool_choice"
    assert refusal({"tools": [WEATHER, WEATHER]}).param == "tools"
    bad_name = {**WEATHER, "function": {**WEATHER["function"], "name": "get weather"}}
    assert refusal({"tools": [bad_name]}).param == "tools"
    not_object = {**WEATHER, "function": {"name": "f", "parameters": {"type": "string"}}}
    assert refusal({"tools": [not_object]}).param == "tools"
    forced_and_format = {
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    assert refusal(forced_and_format).param == "response_format"


def test_forced_choice_adds_a_schema_grammar() -> None:
    params: dict[str, Any] = {}
    named = {"type": "function", "function": {"name": "get_weather"}}
    ToolUse.from_request(request(tools=[WEATHER], tool_choice=named), HERMES).apply(params, True)
    assert json.loads(params["json_schema"]) == WEATHER["function"]["parameters"]
    params = {}
    required = ToolUse.from_request(request(tools=[WEATHER], tool_choice="required"), HERMES)
    required.apply(params, parallel=False)
    schema = json.loads(params["json_schema"])
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1


def test_template_gets_tools_calls_results_and_kwargs(tm: FakeTokenizerManager) -> None:
    from managers.validation import load_chat_template

    tm.chat_template = load_chat_template("smollm2-tools")
    chat = OpenAIServingChat(tm, HERMES)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = request(messages=messages, tools=[WEATHER])
    text = chat.apply_chat_template(req, ToolUse.from_request(req, HERMES))
    assert '"name": "get_weather", "description": "The weather in a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # Without tools, the shipped template renders exactly as the model's own.
    plain = request()
    own = tm.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert chat.apply_chat_template(plain, ToolUse.from_request(plain, HERMES)) == own
    # chat_template_kwargs reach the template; the server's own arguments cannot be set.
    tm.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}NO-THINK {% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    req = request(chat_template_kwargs={"enable_thinking": False})
    assert chat.apply_chat_template(req, ToolUse.from_request(req, HERMES)).startswith("NO-THINK")
    req = request(chat_template_kwargs={"tools": []})
    with pytest.raises(RequestError) as err:
        chat.apply_chat_template(req, ToolUse.from_request(req, HERMES))
    assert err.value.param == "chat_template_kwargs"
    with pytest.raises(RequestError) as err:
        req = request(messages=[{"role": "tool", "content": "x"}])
        chat.apply_chat_template(req, ToolUse.from_request(req, HERMES))
    assert err.value.param == "messages"


def read(tool_use: ToolUse, text: str, split: int) -> tuple[str, str, list[Any]]:
    """(reasoning, content, calls) of `text` streamed in pieces of `split` characters."""
    reader = tool_use.reader()
    reasoning, content, calls = "", "", []
    for i in range(0, len(text), split):
        piece = reader.feed(text[i : i + split])
        reasoning, content, calls = (
            reasoning + piece.reasoning,
            content + piece.content,
            calls + piece.calls,
        )
    piece = reader.finish()
    return reasoning + piece.reasoning, content + piece.content, join_calls(calls + piece.calls)


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_reader_splits_reasoning_then_calls(split: int) -> None:
    text = (
        "<think>Paris, so get_weather.</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    reasoning, content, calls = read(
        ToolUse.from_request(request(tools=[WEATHER]), HERMES), text, split
    )
    assert reasoning == "Paris, so get_weather."
    assert content.strip() == "Checking."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    # separate_reasoning false: the thinking stays in the content, calls are still read.
    no_split = ToolUse.from_request(request(tools=[WEATHER], separate_reasoning=False), HERMES)
    reasoning, content, calls = read(no_split, text, split)
    assert reasoning == "" and content.startswith("<think>Paris") and len(calls) == 1


def test_deepseek_r1_reasoning_starts_open() -> None:
    server = ServerToolConfig(reasoning_parser="deepseek-r1")
    tool_use = ToolUse.from_request(request(), server)
    assert read(tool_use, "thinking</think>answer", 2)[:2] == ("thinking", "answer")
    assert read(tool_use, "never closed", 2)[:2] == ("never closed", "")
