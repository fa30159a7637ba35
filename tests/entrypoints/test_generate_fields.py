"""The native `/generate` body: what SGLang's clients and router send is accepted, an unknown
or unsupported field is a 400 naming it, and the sampling keys follow `SamplingParams`."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from managers.errors import RequestError
from managers.io_struct import GenerateReqInput
from srt.entrypoints.native_protocol import GENERATE_FIELDS, parse_generate


def _parse(body: dict[str, Any]) -> list[GenerateReqInput]:
    return parse_generate(body, 64)[0]


def test_generate_accepts_what_sglang_clients_send() -> None:
    bench = {
        "text": "Hi",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
        "rid": "r-1",
    }
    # What sglang-router's PD mode sends (it re-serializes the body from its own struct).
    router = {
        "text": "Hi",
        "model": None,
        "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 3,
    }
    assert _parse(bench)[0].sampling_params["max_new_tokens"] == 8
    assert _parse(router)[0].bootstrap == ("10.0.0.1", 8998, 3)
    assert _parse({"text": "Hi", "timeout": 5.0, "priority": 0})[0].timeout == 5.0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "Hi", "foo": 1}, "foo"),
        ({"text": "Hi", "lora_path": "adapter-a"}, "lora_path"),
        ({"text": "Hi", "image_data": "http://x/y.png"}, "image_data"),
        ({"text": "Hi", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "Hi", "return_entropy": 0}, "return_entropy"),  # 0 is not false
        ({"text": "Hi", "log_metrics": "yes"}, "log_metrics"),  # a no-op keeps its type
        ({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}}, "temprature"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"best_of": 2}]}, "best_of"),
    ],
)
def test_generate_refuses_unknown_fields(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        _parse(body)
    assert info.value.param == param and info.value.status_code == 400
    assert param in info.value.message


def test_generate_sampling_keys_follow_the_dataclass() -> None:
    from srt.sampling.sampling_params import SamplingParams

    every = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    every.pop("stop_str_max_len")
    every.pop("stop_regex_tail")
    keys = {k: v for k, v in every.items() if v is not dataclasses.MISSING}
    assert _parse({"text": "Hi", "sampling_params": keys})[0].sampling_params == keys
    assert all(rule.origin == "sglang" for rule in GENERATE_FIELDS.values())
