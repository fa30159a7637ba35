"""Tool-call parsers (hermes, llama3, mistral, forced): canned model outputs -> content and calls.

Every canned text is checked twice: `parse` against the expected answer, and streams of it
(split at every position, one character at a time, random splits) against `parse`, so a
streamed response always says what a non-streamed one says. The stream deltas themselves are
checked for shape: one name delta per call, first, indexes in order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

import pytest

from srt.function_call import (
    TOOL_PARSERS,
    ForcedToolCallParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolSpec,
    tool_choice_schema,
)
from srt.function_call.core import join_calls

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    ToolSpec("get_weather", WEATHER),
    ToolSpec("search", {"type": "object", "properties": {"q": {"type": "string"}}}),
    ToolSpec("ping"),  # no parameters
]
TRICKY_ARGS = '{"q": "a } \\" {"}'  # braces and an escaped quote inside a string


def call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """The ways a stream may cut `text`: whole, at each position, per character, randomly."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        deltas += out.calls
    out = parser.finish()
    return content + out.content, deltas + out.calls


def check_delta_shape(deltas: list[ToolCallDelta]) -> None:
    named: set[int] = set()
    for d in deltas:
        assert d.name is not None or d.arguments, "an empty delta"
        if d.name is not None:
            assert d.index == len(named), "calls are announced in index order"
            assert not d.arguments, "the name delta carries no arguments"
            named.add(d.index)
        else:
            assert d.index in named, "arguments before the call's name"


def check(make: Callable[[], ToolCallParser], text: str, content: str, calls: list[ToolCall]):
    assert make().parse(text) == (content, calls)
    for pieces in splits(text):
        got_content, deltas = stream(make(), pieces)
        check_delta_shape(deltas)
        assert (got_content, join_calls(deltas)) == (content, calls), pieces


def named_parser(name: str) -> Callable[[], ToolCallParser]:
    return lambda: TOOL_PARSERS.create(name, TOOLS)


# -- hermes / qwen25 ------------------------------------------------------------------------

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
HERMES_CASES = {
    "single": (
        f"<tool_call>\n{PARIS}\n</tool_call>",
        "",
        [call("get_weather", '{"city": "Paris"}')],
    ),
    "text around": (
        f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>\n\nIt is sunny.",
        "Let me check.\nIt is sunny.",
        [call("get_weather", '{"city": "Paris"}')],
    ),
    "parallel": (
        f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call>\n",
        "",
        [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Rome"}')],
    ),
    "arguments before name": (
        '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
        "",
        [call("search", '{"q": "x"}')],
    ),
    "unknown name": (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok',
        [],
    ),
    "arguments before an unknown name": (
        '<tool_call>{"arguments": {"q": "x"}, "name": "nope"}</tool_call>',
        '<tool_call>{"arguments": {"q": "x"}, "name": "nope"}</tool_call>',
        [],
    ),
    "mismatched bracket": (
        '<tool_call>{"name": "search", "arguments": {"q": [1}}</tool_call>x',
        "x",
        [call("search", '{"q": [1')],
    ),
    "unknown then known": (
        f'<tool_call>{{"name": "nope"}}</tool_call>\n<tool_call>{ROME}</tool_call>',
        '<tool_call>{"name": "nope"}</tool_call>\n',
        [call("get_weather", '{"city": "Rome"}')],
    ),
    "malformed": (
        "<tool_call>{name: get_weather}</tool_call>",
        "<tool_call>{name: get_weather}</tool_call>",
        [],
    ),
    "unquoted name": (
        '<tool_call>{"name": get_weather}</tool_call>',
        '<tool_call>{"name": get_weather}</tool_call>',
        [],
    ),
    "not json": ("<tool_call>call it</tool_call>", "<tool_call>call it</tool_call>", []),
    "no name": (
        '<tool_call>{"arguments": {"q": 1}}</tool_call>',
        '<tool_call>{"arguments": {"q": 1}}</tool_call>',
        [],
    ),
    "cut off in arguments": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [call("get_weather", '{"city": "Par')],
    ),
    "cut off in name": ('<tool_call>{"name": "get_wea', '<tool_call>{"name": "get_wea', []),
    "tricky strings": (
        f'<tool_call>{{"name": "search", "arguments": {TRICKY_ARGS}}}</tool_call>',
        "",
        [call("search", TRICKY_ARGS)],
    ),
    "marker prefix": ("Use <toolkit> or <tool_cal", "Use <toolkit> or <tool_cal", []),
    "no arguments member": ('<tool_call>{"name": "ping"}</tool_call>', "", [call("ping", "{}")]),
    "no close tag": (f"<tool_call>{PARIS} bye", "bye", [call("get_weather", '{"city": "Paris"}')]),
    "broken after the name": (
        '<tool_call>{"name": "search", "arguments": {"q": "x"} oops}</tool_call>\nafter',
        "after",
        [call("search", '{"q": "x"}')],
    ),
}


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
@pytest.mark.parametrize("name", ["hermes", "qwen25"])
def test_hermes(name: str, case: str) -> None:
    check(named_parser(name), *HERMES_CASES[case])


def test_hermes_streams_as_soon_as_known() -> None:
    parser = TOOL_PARSERS.create("hermes", TOOLS)
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("kit>").content == "<toolkit>"
    out = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert out.content == ""
    assert out.calls == [
        ToolCallDelta(index=0, name="get_weather"),
        ToolCallDelta(index=0, arguments='{"city": "Par'),
    ]
    out = parser.feed('is"}}</tool_call>')  # the last fragment arrives with the last chunk
    assert out.calls == [ToolCallDelta(index=0, arguments='is"}')]
    assert parser.finish().calls == []


def test_hermes_buffers_arguments_until_the_name() -> None:
    parser = TOOL_PARSERS.create("hermes", TOOLS)
    assert parser.feed('<tool_call>{"arguments": {"q": "x"}, ').calls == []
    assert parser.feed('"name": "search"').calls == [
        ToolCallDelta(index=0, name="search"),
        ToolCallDelta(index=0, arguments='{"q": "x"}'),
    ]


def test_call_completing_in_the_last_chunk() -> None:
    for name, text in [
        ("hermes", f"<tool_call>{PARIS}</tool_call>"),
        ("llama3", PARIS),
        ("mistral", f"[TOOL_CALLS][{PARIS}]"),
    ]:
        parser = TOOL_PARSERS.create(name, TOOLS)
        cut = text.index("Paris") + 3
        first = parser.feed(text[:cut])
        last = parser.feed(text[cut:])
        assert last.calls == [ToolCallDelta(index=0, arguments='is"}')], name
        assert join_calls(first.calls + last.calls + parser.finish().calls) == [
            call("get_weather", '{"city": "Paris"}')
        ]


def test_no_tools_means_no_calls() -> None:
    text = f"<tool_call>{PARIS}</tool_call>"
    assert TOOL_PARSERS.create("hermes", []).parse(text) == (text, [])


# -- llama3 ------------------------------------------------------------------------------------

L_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_CASES = {
    "single with python_tag": (
        f"<|python_tag|>{L_PARIS}",
        "",
        [call("get_weather", '{"city": "Paris"}')],
    ),
    "single bare": (f"\n {L_PARIS}", "", [call("get_weather", '{"city": "Paris"}')]),
    "text before is content": (f"Sure: {L_PARIS}", f"Sure: {L_PARIS}", []),
    "text after": (f"{L_PARIS}\n\nDone.", "Done.", [call("get_weather", '{"city": "Paris"}')]),
    "parallel": (
        f'<|python_tag|>{L_PARIS}; {{"name": "search", "arguments": {{"q": "x"}}}}',
        "",
        [call("get_weather", '{"city": "Paris"}'), call("search", '{"q": "x"}')],
    ),
    "unknown name": (
        '<|python_tag|>{"name": "nope", "parameters": {}}',
        '<|python_tag|>{"name": "nope", "parameters": {}}',
        [],
    ),
    "unknown second call": (
        f'{L_PARIS}; {{"name": "nope", "parameters": {{}}}}',
        '; {"name": "nope", "parameters": {}}',
        [call("get_weather", '{"city": "Paris"}')],
    ),
    "malformed": (
        '{"name": get_weather, "parameters": {}}',
        '{"name": get_weather, "parameters": {}}',
        [],
    ),
    "broken after the name": (
        '{"name": "ping", "parameters": {}]',
        "]",
        [call("ping", "{}")],
    ),
    "plain json answer": ('  {"answer": 42}', '  {"answer": 42}', []),
    "python code": (
        "<|python_tag|>brave_search.call(query='x')",
        "<|python_tag|>brave_search.call(query='x')",
        [],
    ),
    "cut off": ('{"name": "search", "parameters": {"q": "ab', "", [call("search", '{"q": "ab')]),
    "tricky strings": (
        f'{{"name": "search", "parameters": {TRICKY_ARGS}}}',
        "",
        [call("search", TRICKY_ARGS)],
    ),
    "marker prefix": ("<|python_tagger|> hi", "<|python_tagger|> hi", []),
    "marker prefix at the end": (" <|python", " <|python", []),
    "plain text": ("  Hello there", "  Hello there", []),
}


@pytest.mark.parametrize("case", sorted(LLAMA3_CASES))
def test_llama3(case: str) -> None:
    check(named_parser("llama3"), *LLAMA3_CASES[case])


# -- mistral ---------------------------------------------------------------------------------

MISTRAL_CASES = {
    "single": (f"[TOOL_CALLS] [{PARIS}]", "", [call("get_weather", '{"city": "Paris"}')]),
    "text around": (
        f"Checking.[TOOL_CALLS][{PARIS}]\n more",
        "Checking.more",
        [call("get_weather", '{"city": "Paris"}')],
    ),
    "parallel": (
        f"[TOOL_CALLS][{PARIS}, {ROME}]",
        "",
        [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Rome"}')],
    ),
    "bare object": (f"[TOOL_CALLS] {PARIS}", "", [call("get_weather", '{"city": "Paris"}')]),
    "unknown name": (
        '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
        [],
    ),
    "malformed": ("[TOOL_CALLS][{name}]", "[TOOL_CALLS][{name}]", []),
    "cut off": (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "a',
        "",
        [call("search", '{"q": "a')],
    ),
    "tricky strings": (
        f'[TOOL_CALLS][{{"arguments": {TRICKY_ARGS}, "name": "search"}}]',
        "",
        [call("search", TRICKY_ARGS)],
    ),
    "marker prefix": ("a [TOOLS] b [TOOL_CALL", "a [TOOLS] b [TOOL_CALL", []),
}


@pytest.mark.parametrize("case", sorted(MISTRAL_CASES))
def test_mistral(case: str) -> None:
    check(named_parser("mistral"), *MISTRAL_CASES[case])


def test_special_token_needs() -> None:
    assert not TOOL_PARSERS.get("hermes").needs_special_tokens
    assert TOOL_PARSERS.get("llama3").needs_special_tokens
    assert TOOL_PARSERS.get("mistral").needs_special_tokens


# -- forced tool choice ------------------------------------------------------------------------

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
