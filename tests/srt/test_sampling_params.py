from __future__ import annotations

from typing import Any

import pytest

from srt.sampling.sampling_params import SamplingParams


def test_defaults_are_sglang_native() -> None:
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert p.min_new_tokens == 0
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop is None and p.stop_token_ids is None
    assert not p.ignore_eos and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.no_stop_trim and p.n == 1 and p.seed is None
    assert p.json_schema is None and p.regex is None and p.ebnf is None
    p.verify(vocab_size=100)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -0.1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": 0}),
        ("top_k", {"top_k": -2}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.1}),
        ("frequency_penalty", {"frequency_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -2.5}),
        ("presence_penalty", {"presence_penalty": -3.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": 2.5}),
        ("max_new_tokens", {"max_new_tokens": -1}),
        ("min_new_tokens", {"min_new_tokens": -1}),
        ("min_new_tokens", {"min_new_tokens": 10, "max_new_tokens": 5}),
        ("n", {"n": 0}),
        ("stop_token_ids", {"stop_token_ids": [5, 100]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("regex", {"json_schema": "{}", "regex": "a+"}),
        ("ebnf", {"regex": "a+", "ebnf": "root ::= 'a'"}),
    ],
)
def test_verify_rejects_bad_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).verify(vocab_size=100)


def test_verify_accepts_edges() -> None:
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=2.0,
        max_new_tokens=None,
        min_new_tokens=7,
        stop_token_ids=[0, 99],
        regex="a+",
    ).verify(vocab_size=100)
    # Without a vocabulary size, stop ids are not range-checked.
    SamplingParams(stop_token_ids=[10**9]).verify()


def test_from_dict_ignores_unknown_keys() -> None:
    p = SamplingParams.from_dict(
        {"temperature": 0.5, "top_k": 20, "stop": "###", "logprobs": True, "model": "x"}
    )
    assert p.temperature == 0.5 and p.top_k == 20 and p.stop == "###"
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_normalize_stop_and_greedy() -> None:
    p = SamplingParams(stop="END", temperature=0.0, top_k=40)
    p.normalize()
    assert p.stop == ["END"]
    assert p.stop_str_max_len == 3
    assert p.top_k == 1 and p.is_greedy

    q = SamplingParams(stop=["a", "four", "xy"], stop_token_ids=(1, 2))  # type: ignore[arg-type]
    q.normalize()
    assert q.stop == ["a", "four", "xy"] and q.stop_str_max_len == 4
    assert q.stop_token_ids == [1, 2]
    assert not q.is_greedy

    r = SamplingParams()
    r.normalize()
    assert r.stop == [] and r.stop_str_max_len == 0


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
