"""Forced tool choice (`tool_choice` named or "required"): the parser of what the grammar
makes the model write, and the JSON schema that grammar is compiled from."""

from __future__ import annotations

import json

import pytest

from srt.function_call import ForcedToolCallParser, ToolCallDelta, ToolSpec, tool_choice_schema
from tests.srt.tool_call_helpers import TOOLS, TRICKY_ARGS, WEATHER, call, check

FORCED_CASES = {
    "named": ("get_weather", '{"city": "Paris"}', [call("get_weather", '{"city": "Paris"}')]),
    "named tricky": ("search", TRICKY_ARGS, [call("search", TRICKY_ARGS)]),
    "required one": (
        None,
        '[{"name": "search", "parameters": {"q": "}"}}]',
        [call("search", '{"q": "}"}')],
    ),
    "required two": (
        None,
        (
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "ping", "parameters": {}}]'
        ),
        [call("get_weather", '{"city": "Paris"}'), call("ping", "{}")],
    ),
}


@pytest.mark.parametrize("case", sorted(FORCED_CASES))
def test_forced(case: str) -> None:
    named, text, calls = FORCED_CASES[case]
    check(lambda: ForcedToolCallParser(TOOLS, named), text, "", calls)


def test_forced_named_announces_at_the_first_feed() -> None:
    parser = ForcedToolCallParser(TOOLS, "ping")
    assert parser.feed("").calls == [ToolCallDelta(index=0, name="ping")]
    assert parser.feed("{}").calls == [ToolCallDelta(index=0, arguments="{}")]
    assert parser.feed(" trailing").calls == []  # never past the closing brace
    assert ForcedToolCallParser(TOOLS, "ping").parse("") == ("", [call("ping", "")])


def test_tool_choice_schema_shapes() -> None:
    assert tool_choice_schema(TOOLS, "get_weather", parallel=True) == WEATHER
    assert tool_choice_schema(TOOLS, "ping", parallel=True) == {"type": "object"}
    schema = tool_choice_schema(TOOLS, None, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert "maxItems" not in tool_choice_schema(TOOLS, None, parallel=True)
    ping = schema["items"]["anyOf"][2]
    assert ping["properties"] == {
        "name": {"type": "string", "enum": ["ping"]},
        "parameters": {"type": "object"},
    }
    with pytest.raises(ValueError):
        tool_choice_schema(TOOLS, "nope", parallel=True)


def test_tool_choice_schema_compiles_with_xgrammar() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    tools = [
        ToolSpec(
            f"tool_{i}",
            None
            if i % 3 == 0
            else {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "s": {"type": "string"}},
                "required": ["x"],
            },
        )
        for i in range(20)
    ]
    for parallel in (False, True):
        schema = tool_choice_schema(tools, None, parallel)
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        assert "root" in str(grammar)
    accepts = getattr(getattr(xgrammar, "testing", None), "_is_grammar_accept_string", None)
    if accepts is None:
        return  # a private helper; the compile check above is the contract
    grammar = xgrammar.Grammar.from_json_schema(
        json.dumps(tool_choice_schema(tools, None, True)), any_whitespace=False
    )
    # What the grammar makes the model write is what the parser reads.
    text = '[{"name": "tool_1", "parameters": {"x": 1, "s": "}"}}, {"name": "tool_0", "parameters": {}}]'
    assert accepts(grammar, text)
    parser = ForcedToolCallParser(tools, None)
    assert parser.parse(text) == (
        "",
        [call("tool_1", '{"x": 1, "s": "}"}'), call("tool_0", "{}")],
    )
