"""One validation layer, one set of limits: the OpenAI request models and
`/generate`'s `parse_sampling_params` accept and refuse the same values, neither coerces a
string into a number or a boolean, and an empty stop string is refused by both."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from managers.errors import RequestError
from managers.validation import parse_sampling_params
from srt.entrypoints.http_errors import request_error_from_validation
from srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.sampling.sampling_params import MAX_N, MAX_STOP_SEQUENCES, MAX_TEMPERATURE

VOCAB = 1000
# OpenAI names for the native fields that differ.
OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# (native field, value, accepted?)
CASES: list[tuple[str, Any, bool]] = [
    ("temperature", 0.0, True),
    ("temperature", MAX_TEMPERATURE, True),
    ("temperature", 1, True),  # an int where a number is expected is a number
    ("temperature", 1e9, False),
    ("temperature", MAX_TEMPERATURE + 0.5, False),
    ("temperature", -0.1, False),
    ("temperature", "0.5", False),
    ("temperature", True, False),
    ("top_p", 1.0, True),
    ("top_p", 0.0, False),
    ("top_p", "0.5", False),
    ("top_k", 40, True),
    ("top_k", "40", False),
    ("top_k", 40.0, False),
    ("min_p", 1.5, False),
    ("presence_penalty", -2.0, True),
    ("presence_penalty", 2.5, False),
    ("frequency_penalty", -2.5, False),
    ("repetition_penalty", 2.0, True),
    ("repetition_penalty", 0.0, False),
    ("repetition_penalty", 3.0, False),
    ("n", MAX_N, True),
    ("n", MAX_N + 1, False),
    ("n", 2.0, False),
    ("n", "2", False),
    ("max_new_tokens", 16, True),
    ("max_new_tokens", "16", False),
    ("max_new_tokens", 16.0, False),
    ("max_new_tokens", -1, False),
    ("min_new_tokens", "1", False),
    ("seed", 7, True),
    ("seed", "7", False),
    ("ignore_eos", True, True),
    ("ignore_eos", "true", False),
    ("ignore_eos", 1, False),
    ("skip_special_tokens", "false", False),
    ("stop", "END", True),
    ("stop", ["a"] * MAX_STOP_SEQUENCES, True),
    ("stop", ["a"] * (MAX_STOP_SEQUENCES + 1), False),
    ("stop", "", False),
    ("stop", ["END", ""], False),
    ("stop", [1], False),
    ("stop_token_ids", [1, 2], True),
    ("stop_token_ids", ["1"], False),
]


def native_accepts(field: str, value: Any) -> tuple[bool, str | None]:
    try:
        parse_sampling_params({field: value}, VOCAB)
    except RequestError as e:
        return False, e.param
    return True, None


def openai_accepts(model: type, body: dict[str, Any]) -> tuple[bool, str | None]:
    try:
        model.model_validate(body)
    except ValidationError as e:
        return False, request_error_from_validation(e).param
    return True, None


@pytest.mark.parametrize(("field", "value", "accepted"), CASES)
def test_native_and_openai_agree(field: str, value: Any, accepted: bool) -> None:
    name = OPENAI_NAME.get(field, field)
    native = native_accepts(field, value)
    completion = openai_accepts(CompletionRequest, {"prompt": "x", name: value})
    chat = openai_accepts(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], name: value}
    )
    expected = (True, None) if accepted else (False, field)
    assert native == expected, native
    assert completion == chat == (expected[0], None if accepted else name), (completion, chat)


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "true"), ("echo", "true"), ("logprobs", "2"), ("logprobs", 2.0)],
)
def test_openai_only_fields_are_strict(field: str, value: Any) -> None:
    assert openai_accepts(CompletionRequest, {"prompt": "x", field: value}) == (False, field)


def test_chat_logprobs_flag_is_strict() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}
    assert openai_accepts(ChatCompletionRequest, body) == (False, "logprobs")


def test_empty_stop_message_names_the_reason() -> None:
    with pytest.raises(RequestError, match="empty") as err:
        parse_sampling_params({"stop": ""}, VOCAB)
    assert err.value.param == "stop" and err.value.status_code == 400


def test_stop_regex_without_a_tokenizer_is_refused() -> None:
    from managers.io_struct import GenerateReqInput
    from managers.validation import prepare_prompt

    obj = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"stop_regex": "a+"})
    with pytest.raises(RequestError, match="tokenizer") as err:
        prepare_prompt(obj, None, 4096, VOCAB, 8)
    assert err.value.param == "stop_regex"
    plain = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"stop_regex": []})
    assert prepare_prompt(plain, None, 4096, VOCAB, 8)[1].stop_regex == []
