"""`/v1/responses` over a scripted tokenizer manager (`FakeTokenizerManager`, a test double):
what the default model does not write on its own (a reasoning item, a call read by the hermes
parser under tool_choice auto), how `input` items and `previous_response_id` become the
prompt, the bounded store, and a failure after a stream began. The real server's side is
`tests/server/test_responses.py`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from managers.validation import load_chat_template
from srt.entrypoints.openai.tool_use import ServerToolConfig
from tests.entrypoints.fake_tokenizer_manager import TRIGGER_ABORT, FakeTokenizerManager
from tests.entrypoints.helpers import serve_openai_routes

STORE_SIZE = 2
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
THINKING = "<think>The user greets me.</think>Hello there!"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedTM(FakeTokenizerManager):
    """Replies with `script`, whatever the prompt."""

    script = "Hello world."

    def reply_text(self, prompt: str, j: int) -> str:  # type: ignore[override]
        return self.script


@pytest.fixture(scope="module")
def session(default_model_path: str) -> Iterator[tuple[ScriptedTM, openai.OpenAI]]:
    from srt.model_loader.sources import get_tokenizer

    tm = ScriptedTM(get_tokenizer(default_model_path), default_model_path)
    tools = ServerToolConfig(tool_call_parser="hermes", reasoning_parser="qwen3")
    with serve_openai_routes(tm, tools=tools, response_store_size=STORE_SIZE) as url:
        yield tm, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def tm(session: tuple[ScriptedTM, openai.OpenAI]) -> ScriptedTM:
    tm = session[0]
    tm.reset()
    tm.chat_template = load_chat_template("smollm2-tools")
    return tm


@pytest.fixture
def client(session: tuple[ScriptedTM, openai.OpenAI]) -> openai.OpenAI:
    return session[1]


def prompt(tm: ScriptedTM) -> str:
    return tm.tokenizer.decode(tm.received[-1].input_ids)


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        data.pop("id", None)
        data.pop("call_id", None)
        out.append(data)
    return out


def test_reasoning_item_then_message(tm: ScriptedTM, client: openai.OpenAI) -> None:
    tm.script = THINKING
    full = client.responses.create(model="m", input="Hi!")
    assert [item.type for item in full.output] == ["reasoning", "message"]
    assert full.output[0].content[0].text == "The user greets me."
    assert full.output_text == "Hello there!"
    assert full.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="m", input="Hi!") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user greets me."
    assert without_ids(final.output) == without_ids(full.output)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_read_by_the_parser(
    tm: ScriptedTM, client: openai.OpenAI, stream: bool
) -> None:
    tm.script = CALL
    kw: dict[str, Any] = {"model": "m", "input": "Weather in Paris?", "tools": [WEATHER]}
    if stream:
        with client.responses.stream(**kw) as s:
            events = list(s)
            out = s.get_final_response()
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["function_call"]
    else:
        out = client.responses.create(**kw)
    [call] = out.output
    assert (call.type, call.name) == ("function_call", "get_weather")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert "get_weather" in prompt(tm)  # the template showed the tool (tool_choice auto)


def test_input_items_become_the_conversation(tm: ScriptedTM, client: openai.OpenAI) -> None:
    """A client sends back the output items and the function's output, as the Agents SDK
    does: the template renders the call and its result."""
    tm.script = CALL
    first = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER])
    call = first.output[0]
    tm.script = "It is sunny."
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"},
    ]
    out = client.responses.create(model="m", input=items, tools=[WEATHER])
    assert out.output_text == "It is sunny."
    text = prompt(tm)
    assert "Sunny, 25 C" in text and '"city": "Paris"' in text


def test_previous_response_id_and_instructions(tm: ScriptedTM, client: openai.OpenAI) -> None:
    tm.script = "Noted."
    first = client.responses.create(
        model="m", input="My name is Ada.", instructions="SECRET-RULE: be terse."
    )
    assert "SECRET-RULE" in prompt(tm)
    client.responses.create(model="m", input="What is my name?", previous_response_id=first.id)
    text = prompt(tm)
    # The earlier turn, question and answer, is in the prompt; its instructions are not.
    assert "My name is Ada." in text and "Noted." in text and "What is my name?" in text
    assert "SECRET-RULE" not in text


def test_the_store_keeps_the_latest_responses(tm: ScriptedTM, client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="m", input=f"turn {i}").id for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(ids[0])
    assert f"last {STORE_SIZE} responses" in err.value.body["message"]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    client.responses.create(model="m", input="again", previous_response_id=ids[-1])


def test_a_failure_after_the_stream_began_is_an_error_event(
    tm: ScriptedTM, client: openai.OpenAI
) -> None:
    """OpenAI's `error` event (type, code, message, param), and no terminal response event."""
    tm.script = "one two three four five six"
    with client.responses.stream(model="m", input=f"{TRIGGER_ABORT} please") as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-1] == "error" and events[-1].message == "Aborted by the scheduler"
    assert events[-1].code == "503"


def test_a_refusal_before_the_stream_began_is_a_plain_error(
    tm: ScriptedTM, client: openai.OpenAI
) -> None:
    with (
        pytest.raises(openai.BadRequestError) as err,
        client.responses.stream(model="m", input="TRIGGER_REQUEST_ERROR") as stream,
    ):
        list(stream)
    assert "too long" in err.value.body["message"]
