"""Regex and EBNF constraints with the default model: outputs match their regex or parse
with the grammar's own parser (tests/constrained/grammars.py)."""

from __future__ import annotations

import re

import pytest

from managers.inprocess import InProcessDriver
from tests.constrained.grammars import ARITH, KV, REGEXES, parse_arith, parse_kv
from tests.constrained.helpers import assert_stopped_at_eos, chat

pytestmark = pytest.mark.slow


def test_parsers_reject_what_the_grammars_reject() -> None:
    assert parse_arith("(3 * 4) + 12") == 2
    assert parse_kv('host="example"; port=8080; tls=true') == {
        "host": "example",
        "port": "8080",
        "tls": "true",
    }
    for bad in ("24", "1 + 2 + 3 + 4 + 5", "(1 + 2", "01 + 2", "1 +2", "((1 + 2) + 3) * 4"):
        with pytest.raises(ValueError):
            parse_arith(bad)
    for bad in ("port", "port=", "a=1;b=2", "a=1; b=2; c=3; d=4; e=5", 'x="a-b"', "Key=1"):
        with pytest.raises(ValueError):
            parse_kv(bad)


def test_regex_and_ebnf_outputs_match(default_driver: InProcessDriver) -> None:
    cases: list[tuple[str, dict, object]] = []
    for regex, prompt in REGEXES:
        cases.append((prompt, {"regex": regex}, lambda t, r=regex: re.fullmatch(r, t)))
    cases.append(
        (
            "Write an arithmetic expression that equals 24, like (3 * 4) + 12.",
            {"ebnf": ARITH},
            parse_arith,
        )
    )
    cases.append(
        (
            "List the settings of a web server as key=value pairs separated by semicolons.",
            {"ebnf": KV},
            parse_kv,
        )
    )
    prompts, params = [], []
    for temperature in (0.0, 0.8):
        for prompt, constraint, _ in cases:
            prompts.append(chat(default_driver, prompt))
            params.append(
                {"max_new_tokens": 128, "temperature": temperature, "seed": 5, **constraint}
            )
    outs = default_driver.generate(prompts, params)
    for i, out in enumerate(outs):
        _, constraint, check = cases[i % len(cases)]
        assert_stopped_at_eos(default_driver, out)
        assert check(out["text"]), (constraint, out["text"])
    default_driver.scheduler.check_memory()
