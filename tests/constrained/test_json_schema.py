"""JSON schemas with the default model: twenty schemas at temperature 0 and 0.8, parallel
sampling (n > 1), and the compile cache shared by requests with the same schema."""

from __future__ import annotations

import json

import pytest

from constrained.base_grammar_backend import GrammarKey
from managers.inprocess import InProcessDriver
from tests.constrained.helpers import assert_valid_json, chat
from tests.constrained.schemas import SCHEMAS

pytestmark = pytest.mark.slow


def test_twenty_schemas_greedy_and_sampled(default_driver: InProcessDriver) -> None:
    prompts = [
        chat(default_driver, f"Give me a JSON object describing {desc}.") for desc, _ in SCHEMAS
    ]
    params = [
        {"max_new_tokens": 256, "temperature": t, "seed": 3, "json_schema": json.dumps(s)}
        for t in (0.0, 0.8)
        for _, s in SCHEMAS
    ]
    outs = default_driver.generate(prompts * 2, params)
    for i, out in enumerate(outs):
        assert_valid_json(default_driver, out, SCHEMAS[i % len(SCHEMAS)][1])
    # any_whitespace=False: compact separators only, no newlines or indentation.
    assert not any("\n" in out["text"] for out in outs)
    default_driver.scheduler.check_memory()


def test_parallel_sampling_gives_n_valid_outputs(default_driver: InProcessDriver) -> None:
    desc, schema = SCHEMAS[0]
    params = {"max_new_tokens": 256, "temperature": 0.8, "seed": 11, "n": 3}
    outs = default_driver.generate(
        [chat(default_driver, f"Give me a JSON object describing {desc}.")],
        {**params, "json_schema": json.dumps(schema)},
    )
    assert len(outs) == 3
    for out in outs:
        assert_valid_json(default_driver, out, schema)
    assert len({out["text"] for out in outs}) > 1, "three samples, all identical"
    default_driver.scheduler.check_memory()


def test_compile_cache_one_future_per_distinct_spec(
    default_driver: InProcessDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = default_driver.scheduler.grammar_backend
    compiled: list[GrammarKey] = []
    real_submit = backend.lanes.submit

    def counting_submit(key: GrammarKey, small: bool) -> object:
        compiled.append(key)
        return real_submit(key, small)

    monkeypatch.setattr(backend.lanes, "submit", counting_submit)
    # Schemas no other test uses, so their keys are not cached yet.
    specs = [
        json.dumps(
            {
                "type": "object",
                "properties": {"cache_probe": {"enum": [i]}},
                "required": ["cache_probe"],
                "additionalProperties": False,
            }
        )
        for i in range(2)
    ]
    keys = [GrammarKey("json_schema", s) for s in specs]
    assert not any(k in backend.cache for k in keys)
    before = dict(backend.cache)

    prompt = chat(default_driver, "Give me a JSON object.")
    params = [
        {"max_new_tokens": 32, "temperature": 0.8, "seed": i, "json_schema": specs[i % 2]}
        for i in range(6)
    ]
    outs = default_driver.generate([prompt] * 6, params)

    assert [json.loads(o["text"]) for o in outs] == [{"cache_probe": i % 2} for i in range(6)]
    assert sorted(compiled) == sorted(keys), "six requests, two distinct schemas: two compiles"
    assert set(backend.cache) == set(before) | set(keys)
    assert all(backend.cache[k] is f for k, f in before.items()), "old entries replaced"
    for key in keys:
        future = backend.cache[key]
        assert future.done() and future.exception() is None
        assert backend.compile_async(key) is future
    default_driver.scheduler.check_memory()
