"""`/v1/responses` on the shared real server (default model, `--chat-template smollm2-tools
--tool-call-parser hermes --reasoning-parser qwen3`), with the official `openai` client's
`responses.create` / `responses.stream` and the OpenAI Agents SDK's default model
(`OpenAIResponsesModel`). Reasoning items and parsed (auto) calls, which this model does not
write on its own, are checked over a scripted tokenizer manager in
`tests/entrypoints/test_openai_responses.py`."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import requests

from tests.server.test_aborts_and_errors import wait_idle

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one word."
GREEDY = {"model": "SmolLM2-135M-Instruct", "temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


# xgrammar refuses this when it compiles (the type name is unknown).
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_create_continue_and_retrieve(client: openai.OpenAI, url: str) -> None:
    first = client.responses.create(**GREEDY, input=QUESTION, max_output_tokens=16)
    assert first.status == "completed" and first.id.startswith("resp_")
    assert "Paris" in first.output_text
    [message] = first.output
    assert message.type == "message" and message.role == "assistant"
    usage = first.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The next turn sees the first one's question and answer.
    second = client.responses.create(
        **GREEDY,
        input="And of Germany?",
        previous_response_id=first.id,
        instructions="Be brief.",
        max_output_tokens=16,
    )
    assert "Berlin" in second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > usage.input_tokens + usage.output_tokens
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text
    # Nothing is kept of `store: false`.
    unstored = client.responses.create(**GREEDY, input=QUESTION, store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(**GREEDY, input="more", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    assert "--response-store-size" in err.value.body["message"]


def test_stream_events_and_final_response(client: openai.OpenAI) -> None:
    full = client.responses.create(**GREEDY, input=QUESTION, max_output_tokens=16)
    with client.responses.stream(**GREEDY, input=QUESTION, max_output_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == full.output_text


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, url: str) -> None:
    out = client.responses.create(**GREEDY, input="Tell me a long story.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3
    body = {**GREEDY, "input": "Tell me a long story.", "max_output_tokens": 3, "stream": True}
    with requests.post(url + "/v1/responses", json=body, stream=True, timeout=60) as resp:
        events = [line for line in resp.iter_lines() if line.startswith(b"event: ")]
    assert events[-1] == b"event: response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call(client: openai.OpenAI, stream: bool) -> None:
    kw = {
        **GREEDY,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    if stream:
        with client.responses.stream(**kw) as s:
            events = list(s)
            out = s.get_final_response()
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert deltas == out.output[0].arguments
    else:
        out = client.responses.create(**kw)
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        **GREEDY,
        input="Describe a person as JSON.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.output_text), schema)


def test_agents_sdk_runs_an_agent_with_a_function_tool(url: str) -> None:
    """The Agents SDK's default model: a forced call first, then (its `reset_tool_choice`)
    tool_choice auto with the function's output in the input, until a final answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run() -> tuple[object, object]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="SmolLM2", openai_client=client)
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            tools=[get_weather],
            model=model,
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=48
            ),
        )
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    result, streamed = asyncio.run(run())
    assert calls == ["Paris", "Rome"]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output
    assert isinstance(streamed.final_output, str) and streamed.final_output


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": "hi", "max_output_token": 5}, "max_output_token", 400),
        ({"input": []}, "input", 400),
        ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input", 400),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            400,
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", 400),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", 400),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", 400),
        ({"input": "hi", "truncation": "auto"}, "truncation", 400),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", 400),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text", 400),
        (
            {
                "input": "hi",
                "stream": True,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
            },
            None,
            400,
        ),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id", 404),
        ({"input": "word " * 9000}, None, 400),
    ],
)
def test_bad_requests(url: str, body: dict, param: str | None, status: int) -> None:
    resp = requests.post(url + "/v1/responses", json={"model": "m", **body}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_a_stream_left_early_frees_its_kv(url: str) -> None:
    body = {
        "model": "m",
        "input": "Count from one to one thousand.",
        "max_output_tokens": 2000,
        "stream": True,
    }
    with requests.post(url + "/v1/responses", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        deltas = 0
        for line in lines:
            deltas += line == b"event: response.output_text.delta"
            if deltas == 3:
                break
    state = wait_idle(url)
    assert state["memory_integrity"]["ok"] is not False, state["memory_integrity"]
    info = requests.get(url + "/get_server_info", timeout=30).json()
    assert info["memory_integrity"]["ok"] is True, info["memory_integrity"]
