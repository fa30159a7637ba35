"""Every request field of the OpenAI routes is honoured, a documented no-op, or refused
(`srt/entrypoints/openai/fields.py`), and nothing else is accepted.

The OpenAI field lists come from the installed `openai` client, so a field OpenAI adds fails
`test_every_openai_field_is_classified` until the table says what we do with it. Each field
is then sent, with a representative value, to the routes over `FakeTokenizerManager`:
refused -> 400 naming it; no-op -> 200 and the very request the field-less body makes;
honoured -> 200 and, where it maps to one, the value in the request the double received.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel

from managers.io_struct import GenerateReqInput
from srt.entrypoints.openai import fields
from srt.entrypoints.openai.fields import FieldTable, Treatment
from srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    StreamOptions,
    TextContentPart,
)
from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager
from tests.entrypoints.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error,
    sent_fields,
    without_rid,
)

TABLES: dict[str, FieldTable] = {CHAT: fields.CHAT_FIELDS, COMPLETIONS: fields.COMPLETION_FIELDS}
MODELS: dict[str, type[BaseModel]] = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}


def _openai_fields(*typed_dicts: Any) -> set[str]:
    return {name for td in typed_dicts for name in td.__annotations__}


# What the installed client can send. `stream` is declared on the streaming variants only.
OPENAI_FIELDS = {
    CHAT: _openai_fields(
        chat_params.CompletionCreateParamsBase, chat_params.CompletionCreateParamsStreaming
    ),
    COMPLETIONS: _openai_fields(
        completion_params.CompletionCreateParamsBase,
        completion_params.CompletionCreateParamsStreaming,
    ),
}

# ---- representative values: the fields to add, and (for honoured ones) what must arrive ----

Check = Callable[[GenerateReqInput], bool]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
GRAMMARS = {
    "regex": "(yes|no)",
    "ebnf": 'root ::= "yes" | "no"',
    "json_schema": '{"type": "object"}',
}


def _param(key: str, value: Any) -> Check:
    return lambda obj: obj.sampling_params.get(key) == value


def _attr(name: str, value: Any) -> Check:
    return lambda obj: getattr(obj, name) == value


SHARED: dict[str, tuple[dict[str, Any], Check | None]] = {
    "model": ({"model": "any-name"}, None),  # any name is served
    "max_tokens": ({"max_tokens": 3}, _param("max_new_tokens", 3)),
    "temperature": ({"temperature": 0.5}, _param("temperature", 0.5)),
    "top_p": ({"top_p": 0.9}, _param("top_p", 0.9)),
    "seed": ({"seed": 7}, _param("seed", 7)),
    "presence_penalty": ({"presence_penalty": 0.5}, _param("presence_penalty", 0.5)),
    "frequency_penalty": ({"frequency_penalty": -0.5}, _param("frequency_penalty", -0.5)),
    "n": ({"n": 2}, _param("n", 2)),
    "stop": ({"stop": ["\n"]}, _param("stop", ["\n"])),
    "stream": ({"stream": True}, _attr("stream", True)),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, None),
    "logit_bias": ({"logit_bias": {"1": 2.0}}, _param("logit_bias", {"1": 2.0})),
    "user": ({"user": "user-1"}, None),
    "timeout": ({"timeout": 30.0}, _attr("timeout", 30.0)),
    "priority": ({"priority": 1}, _attr("priority", 1)),
    **{
        name: (
            {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5},
            _attr("bootstrap", ("10.0.0.1", 8998, 5)),
        )
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    },
    "top_k": ({"top_k": 5}, _param("top_k", 5)),
    "min_p": ({"min_p": 0.1}, _param("min_p", 0.1)),
    "repetition_penalty": ({"repetition_penalty": 1.1}, _param("repetition_penalty", 1.1)),
    "min_tokens": ({"min_tokens": 1}, _param("min_new_tokens", 1)),
    "stop_token_ids": ({"stop_token_ids": [2]}, _param("stop_token_ids", [2])),
    "stop_regex": ({"stop_regex": "x+"}, _param("stop_regex", "x+")),
    "ignore_eos": ({"ignore_eos": True}, _param("ignore_eos", True)),
    "skip_special_tokens": ({"skip_special_tokens": False}, _param("skip_special_tokens", False)),
    "spaces_between_special_tokens": (
        {"spaces_between_special_tokens": False},
        _param("spaces_between_special_tokens", False),
    ),
    "no_stop_trim": ({"no_stop_trim": True}, _param("no_stop_trim", True)),
    "response_format": (
        {"response_format": {"type": "json_object"}},
        _param("json_schema", '{"type": "object"}'),
    ),
    **{name: ({name: spec}, _param(name, spec)) for name, spec in GRAMMARS.items()},
    "lora_path": ({"lora_path": "adapter-a"}, None),
    "return_hidden_states": ({"return_hidden_states": True}, None),
}
REPRESENTATIVE: dict[str, dict[str, tuple[dict[str, Any], Check | None]]] = {
    COMPLETIONS: {
        **SHARED,
        "prompt": ({"prompt": "Another prompt"}, _attr("text", "Another prompt")),
        "echo": ({"echo": True}, None),
        "logprobs": ({"logprobs": 2}, _attr("top_logprobs_num", 2)),
        "suffix": ({"suffix": " and so on."}, None),
        "best_of": ({"best_of": 3}, None),
    },
    CHAT: {
        **SHARED,
        "messages": ({"messages": [{"role": "user", "content": "Other"}]}, None),
        "max_completion_tokens": ({"max_completion_tokens": 3}, _param("max_new_tokens", 3)),
        "logprobs": ({"logprobs": True}, _attr("return_logprob", True)),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, _attr("top_logprobs_num", 2)),
        "tools": ({"tools": TOOLS, "tool_choice": "none"}, None),
        "tool_choice": (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            lambda obj: "json_schema" in obj.sampling_params,
        ),
        "parallel_tool_calls": ({"parallel_tool_calls": False}, None),
        "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, None),
        "separate_reasoning": ({"separate_reasoning": False}, None),
        "continue_final_message": ({"continue_final_message": True}, None),
        "stream_reasoning": ({"stream_reasoning": False}, None),
        "metadata": ({"metadata": {"team": "search"}}, None),
        "store": ({"store": True}, None),
        "service_tier": ({"service_tier": "auto"}, None),
        "prompt_cache_key": ({"prompt_cache_key": "conversation-1"}, None),
        "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, None),
        "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit"}}, None),
        "safety_identifier": ({"safety_identifier": "user-hash"}, None),
        "audio": ({"modalities": ["text"], "audio": {"voice": "alloy", "format": "wav"}}, None),
        "modalities": ({"modalities": ["text", "audio"]}, None),
        "prediction": ({"prediction": {"type": "content", "content": "Hello"}}, None),
        "functions": ({"functions": [{"name": "get_weather", "parameters": {}}]}, None),
        "function_call": ({"function_call": "auto"}, None),
        "reasoning_effort": ({"reasoning_effort": "low"}, None),
        "verbosity": ({"verbosity": "low"}, None),
        "web_search_options": ({"web_search_options": {}}, None),
        "moderation": ({"moderation": {"model": "omni-moderation-latest"}}, None),
    },
}


# ---- the table covers what the client can send, and matches the models ----


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_every_openai_field_is_classified(route: str) -> None:
    table = TABLES[route]
    missing = sorted(OPENAI_FIELDS[route] - table.keys())
    assert not missing, f"OpenAI request fields not classified in fields.py: {missing}"
    for name in OPENAI_FIELDS[route]:
        assert table[name].origin == "openai", name
    extras = {name for name, rule in table.items() if rule.origin == "sglang"}
    assert not extras & OPENAI_FIELDS[route], "an OpenAI field is marked as an SGLang extra"


def test_every_openai_embedding_and_responses_field_is_classified() -> None:
    from openai.types import embedding_create_params
    from openai.types.responses import response_create_params

    for params, table in (
        (embedding_create_params.EmbeddingCreateParams, fields.EMBEDDING_FIELDS),
        (response_create_params.ResponseCreateParamsStreaming, fields.RESPONSES_FIELDS),
    ):
        sent = _openai_fields(params)
        assert {"input", "model"} <= sent
        missing = sorted(sent - table.keys())
        assert not missing, f"OpenAI request fields not classified in fields.py: {missing}"


def _message_param_fields() -> set[str]:
    import openai.types.chat as chat_types

    names: set[str] = set()
    for role in ("System", "Developer", "User", "Assistant", "Tool"):
        names |= set(getattr(chat_types, f"ChatCompletion{role}MessageParam").__annotations__)
    return names


def _content_part_types() -> set[str]:
    from openai.types.chat import (
        chat_completion_assistant_message_param as assistant,
    )
    from openai.types.chat import (
        chat_completion_content_part_param as user_parts,
    )

    types: set[str] = set()
    unions = (user_parts.ChatCompletionContentPartParam, assistant.ContentArrayOfContentPart)
    for union in unions:
        for td in typing.get_args(union):
            hints = typing.get_type_hints(td, include_extras=True)
            literal = typing.get_args(hints["type"])[0]  # Required[Literal["text"]]
            types |= set(typing.get_args(literal))
    return types


def test_nested_openai_fields_are_classified() -> None:
    from openai.types.chat import (
        ChatCompletionContentPartTextParam,
        ChatCompletionStreamOptionsParam,
    )

    assert not _message_param_fields() - fields.MESSAGE_FIELDS.keys()
    assert not _content_part_types() - fields.CONTENT_PART_TYPES.keys()
    assert (
        not set(ChatCompletionContentPartTextParam.__annotations__) - fields.TEXT_PART_FIELDS.keys()
    )
    assert (
        not set(ChatCompletionStreamOptionsParam.__annotations__)
        - fields.STREAM_OPTIONS_FIELDS.keys()
    )


@pytest.mark.parametrize(
    ("table", "model"),
    [
        (fields.CHAT_FIELDS, ChatCompletionRequest),
        (fields.COMPLETION_FIELDS, CompletionRequest),
        (fields.MESSAGE_FIELDS, ChatMessage),
        (fields.TEXT_PART_FIELDS, TextContentPart),
        (fields.STREAM_OPTIONS_FIELDS, StreamOptions),
        (fields.EMBEDDING_FIELDS, EmbeddingRequest),
        (fields.RESPONSES_FIELDS, ResponsesRequest),
    ],
)
def test_honoured_fields_are_the_model_fields(table: FieldTable, model: type[BaseModel]) -> None:
    """A declared field is honoured (no-op and refused ones never reach the model), and every
    honoured field of the table is declared."""
    honoured = {name for name, rule in table.items() if rule.treatment is Treatment.HONOURED}
    assert honoured == set(model.model_fields)


def test_every_field_has_a_representative_value() -> None:
    for route, table in TABLES.items():
        assert table.keys() == REPRESENTATIVE[route].keys(), route
        assert sorted(row[0] for row in fields.treatment_table(table)) == sorted(table)


# ---- each field's treatment, through the routes ----


def _check_treatment(base_url: str, tm: FakeTokenizerManager, route: str, name: str) -> None:
    rule = TABLES[route][name]
    extra, check = REPRESENTATIVE[route][name]
    resp, received = sent_fields(base_url, tm, route, extra)
    if rule.treatment is Treatment.REFUSED:
        error = assert_error(resp, 400, name)
        assert rule.why in error["message"]
        assert not received
        return
    assert resp.status_code == 200, resp.text
    assert received
    if rule.treatment is Treatment.NO_OP:
        _, plain = sent_fields(base_url, tm, route, {})
        assert [without_rid(o) for o in received] == [without_rid(o) for o in plain]
    elif check is not None:
        assert check(received[0]), received[0]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_field_treatment(base_url: str, tm: FakeTokenizerManager, route: str) -> None:
    """One test per route, not per field: each test item costs a garbage collection of the
    whole process (tests/conftest.py), far more than a request to the double."""
    failures = []
    for name in sorted(TABLES[route]):
        try:
            _check_treatment(base_url, tm, route, name)
        except AssertionError as err:
            failures.append(f"{name} ({TABLES[route][name].treatment.value}): {err}")
    assert not failures, "\n".join(failures)


# Values of refused fields that ask for nothing: accepted, and the request is unchanged.
ASKS_FOR_NOTHING = [
    (COMPLETIONS, {"best_of": 1}),  # SGLang's benchmark client sends this with n = 1
    (COMPLETIONS, {"best_of": None}),
    (COMPLETIONS, {"suffix": None}),
    (COMPLETIONS, {"suffix": ""}),
    (CHAT, {"modalities": ["text"]}),
    (CHAT, {"audio": None, "functions": None, "reasoning_effort": None}),
    (CHAT, {"lora_path": None}),
    (CHAT, {"stream_options": None}),
    # What sglang-router's PD mode adds to a chat body (it re-serializes it).
    (
        CHAT,
        {"continue_final_message": False, "stream_reasoning": True, "return_hidden_states": False},
    ),
    (COMPLETIONS, {"return_hidden_states": False}),
]


@pytest.mark.parametrize(("route", "extra"), ASKS_FOR_NOTHING)
def test_values_that_ask_for_nothing(
    base_url: str, tm: FakeTokenizerManager, route: str, extra: dict[str, Any]
) -> None:
    resp, received = sent_fields(base_url, tm, route, extra)
    assert resp.status_code == 200, resp.text
    _, plain = sent_fields(base_url, tm, route, {})
    assert [without_rid(o) for o in received] == [without_rid(o) for o in plain]


def test_best_of_equal_to_n(base_url: str, tm: FakeTokenizerManager) -> None:
    resp, received = sent_fields(base_url, tm, COMPLETIONS, {"n": 2, "best_of": 2})
    assert resp.status_code == 200 and received[0].sampling_params["n"] == 2
    error = assert_error(
        sent_fields(base_url, tm, COMPLETIONS, {"n": 2, "best_of": 1})[0], 400, "best_of"
    )
    assert "must equal n" in error["message"]


REFUSED_VALUES = [
    (CHAT, {"store": "yes"}, "store"),  # a no-op field still has to be of its type
    (CHAT, {"metadata": {"k": 1}}, "metadata"),
    (COMPLETIONS, {"user": 42}, "user"),
    (CHAT, {"max_token": 5}, "max_token"),  # unknown (a typo): refused, not ignored
    (COMPLETIONS, {"foo": 1}, "foo"),
    (COMPLETIONS, {"metadata": {"k": "v"}}, "metadata"),  # chat only
    (CHAT, {"echo": True}, "echo"),  # completions only
    (CHAT, {"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    (CHAT, {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}, "json_schema": "{}"}, "json_schema"),
    (CHAT, {"regex": 5}, "regex"),
]


@pytest.mark.parametrize(("route", "extra", "param"), REFUSED_VALUES)
def test_refused_values(
    base_url: str, tm: FakeTokenizerManager, route: str, extra: dict[str, Any], param: str
) -> None:
    resp, received = sent_fields(base_url, tm, route, extra)
    assert_error(resp, 400, param)
    assert not received


def test_unknown_field_message(base_url: str, tm: FakeTokenizerManager) -> None:
    error = assert_error(sent_fields(base_url, tm, CHAT, {"foo": 1})[0], 400, "foo")
    assert error["message"] == "Unrecognized request field `foo`"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}, "color": "red"}}]
    error = assert_error(sent_fields(base_url, tm, CHAT, {"tools": tools})[0], 400, "tools")
    assert error["message"] == "Unrecognized request field `tools.0.function.color`"


def test_grammar_with_text_format_is_fine(base_url: str, tm: FakeTokenizerManager) -> None:
    extra = {"response_format": {"type": "text"}, "regex": "(yes|no)"}
    resp, received = sent_fields(base_url, tm, CHAT, extra)
    assert resp.status_code == 200 and received[0].sampling_params["regex"] == "(yes|no)"
