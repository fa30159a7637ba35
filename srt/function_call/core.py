"""The shapes every tool-call parser shares, and its base class.

A parser walks one choice's output text once, delta by delta:

    parser = TOOL_PARSERS.create(name, tools)
    for delta in text_deltas:
        out = parser.feed(delta)      # StreamDelta: content to show, call pieces to send
    out = parser.finish()             # whatever was held back, at the end of the output

Text that may still turn out to start a call (a prefix of `<tool_call>`, say) is held back
until the next delta decides it; text before, between and after calls is content.
`parse(text)` runs the same walk over a whole text, so streamed and non-streamed answers are
the same calls with the same argument strings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool of the request: its function's name and JSON-schema parameters."""

    name: str
    parameters: dict[str, Any] | None = None


@dataclass(slots=True)
class ToolCall:
    """A complete call. `arguments` is the JSON object text exactly as the model wrote it."""

    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of call `index` (0, 1, ... within the choice), shaped like OpenAI's
    `delta.tool_calls[i]`: the first piece of a call carries its `name`, later ones argument
    fragments; the fragments of a call, joined, are its `arguments`."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolCallParser(ABC):
    """One instance per choice: it keeps the walk's state between deltas."""

    # Whether its markers are special tokens, which the detokenizer must then keep
    # (`skip_special_tokens=False` for requests this parser reads).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[ToolSpec]) -> None:
        self.tools = {tool.name: tool for tool in tools}

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """The next piece of output text -> what can be sent now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """End of output: flush what was held back."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output -> (content, calls), by the same walk as a stream."""
        out = self.feed(text)
        out.extend(self.finish())
        return out.content, join_calls(out.calls)


def join_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Stream pieces -> complete calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ToolCall(name="", arguments=""))
        if d.name is not None:
            call.name = d.name
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
