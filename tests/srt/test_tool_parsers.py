"""Tool-call parsers (hermes, llama3, mistral): canned model outputs -> content and calls.

Every canned text is checked twice: `parse` against the expected answer, and streams of it
(split at every position, one character at a time, random splits) against `parse`, so a
streamed response always says what a non-streamed one says. The stream deltas themselves are
checked for shape: one name delta per call, first, indexes in order.
"""

from __future__ import annotations

import pytest

from srt.function_call import TOOL_PARSERS, ToolCallDelta
from srt.function_call.core import join_calls
from tests.srt.tool_call_helpers import TOOLS, TRICKY_ARGS, call, check, named_parser

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
