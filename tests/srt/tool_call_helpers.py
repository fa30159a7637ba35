"""Canned tools and the check every tool-call parser test makes: `parse` gives the expected
answer, and every way of streaming the same text gives what `parse` gives, in well-formed
deltas (one name delta per call, first, indexes in order)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from srt.function_call import TOOL_PARSERS, ToolCall, ToolCallDelta, ToolCallParser, ToolSpec
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
