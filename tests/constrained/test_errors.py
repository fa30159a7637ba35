"""Invalid constraints: a grammar the compiler rejects finishes its request with a 400 and the
compiler's message, while the other requests of the same batch run as usual; two constraints
on one request are refused before the request is queued."""

from __future__ import annotations

import json

import pytest

from constrained.base_grammar_backend import GrammarError, GrammarKey
from managers.inprocess import InProcessDriver
from tests.constrained.helpers import assert_valid_json, chat

pytestmark = pytest.mark.slow

# (kind, invalid spec, words the compiler's message must contain)
INVALID = [
    ("json_schema", "{not json", "Failed to parse JSON"),
    ("json_schema", json.dumps({"type": "object", "properties": 3}), "properties"),
    ("regex", "(abc", "Regex parsing error"),
    ("regex", "[z-a]", "lower bound is larger than upper bound"),
    ("ebnf", "root ::= (", "EBNF parser error"),
    ("ebnf", 'start ::= "a"', 'root rule with name "root" is not found'),
]

GOOD_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_invalid_grammars_abort_with_400_others_unaffected(default_driver: InProcessDriver) -> None:
    good_prompt = chat(default_driver, "Give me a JSON object naming the capital of France.")
    free_prompt = chat(default_driver, "What is the capital of France? Answer in one word.")
    prompts, params = [], []
    for kind, spec, _ in INVALID:
        # Interleave: a valid constrained and an unconstrained request around each bad one.
        prompts += [good_prompt, chat(default_driver, "Hello!"), free_prompt]
        params += [
            {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(GOOD_SCHEMA)},
            {"max_new_tokens": 64, "temperature": 0, kind: spec},
            {"max_new_tokens": 16, "temperature": 0},
        ]
    outs = default_driver.generate(prompts, params)

    backend = default_driver.scheduler.grammar_backend
    for i, (kind, spec, words) in enumerate(INVALID):
        good, bad, free = outs[3 * i : 3 * i + 3]
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400, reason
        with pytest.raises(GrammarError) as compiler:
            backend.compile(GrammarKey(kind, spec))
        assert reason["message"] == f"Invalid grammar: {compiler.value}"
        assert words in reason["message"] and ".cc:" not in reason["message"], reason
        assert bad["output_ids"] == []

        assert_valid_json(default_driver, good, GOOD_SCHEMA)
        assert free["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        assert "Paris" in free["text"], free["text"]
    # The failed compile stays cached, so the same invalid spec is not compiled again.
    for kind, spec, _ in INVALID:
        assert isinstance(backend.cache[GrammarKey(kind, spec)].exception(), GrammarError)
    default_driver.scheduler.check_memory()


def test_two_constraints_on_one_request_are_refused(default_driver: InProcessDriver) -> None:
    sched = default_driver.scheduler
    n_outputs = len(default_driver.outputs)
    with pytest.raises(ValueError, match="only one of json_schema, regex, ebnf"):
        default_driver.submit(None, {"regex": "a+", "ebnf": 'root ::= "a"'}, text="hi")
    with pytest.raises(ValueError, match="only one of json_schema, regex, ebnf"):
        default_driver.generate(["hi"], {"json_schema": json.dumps(GOOD_SCHEMA), "regex": "a+"})
    assert len(default_driver.outputs) == n_outputs, "a refused request was registered"
    assert not sched.intake.grammar_queue and not sched.queues.waiting
    # The driver keeps working.
    [out] = default_driver.generate(
        [chat(default_driver, "Give me a JSON object naming a city.")],
        {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(GOOD_SCHEMA)},
    )
    assert_valid_json(default_driver, out, GOOD_SCHEMA)
    sched.check_memory()
