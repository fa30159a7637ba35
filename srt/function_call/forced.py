"""Forced tool choice: `tool_choice="required"` or a named function.

The output is not left to the model's own call format: the request's JSON schema grammar
(`tool_choice_schema`, compiled by the grammar backend, e.g. xgrammar) forces it to be exactly
JSON, whatever the model family, and `ForcedToolCallParser` reads it:

- a named function: the output is that function's arguments object;
- "required": the output is an array of `{"name": ..., "parameters": {...}}` objects, one
  per call (at most one unless parallel calls are allowed).

The array is read by the same walk as Mistral's `[TOOL_CALLS]` payload, minus the marker;
nothing of a forced output is content.
"""

from __future__ import annotations

from typing import Any

from srt.function_call.core import StreamDelta, ToolCallDelta, ToolCallParser, ToolSpec
from srt.function_call.json_scan import ValueScanner, skip_whitespace
from srt.function_call.mistral import MistralParser


def _parameters(tool: ToolSpec) -> dict[str, Any]:
    # No schema (or an empty one) still means an object: arguments are always a JSON object.
    return tool.parameters or {"type": "object"}


def tool_choice_schema(tools: list[ToolSpec], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must follow: a named function's parameters, or for
    "required" an array of `{"name", "parameters"}` objects, one alternative per tool.

    Properties are listed "name" first, so the grammar makes the model write the name before
    the arguments, and the name delta can be streamed before them.
    """
    if named is not None:
        for tool in tools:
            if tool.name == named:
                return _parameters(tool)
        raise ValueError(f"tool_choice names {named!r}, which is not one of the tools")
    if not tools:
        raise ValueError('tool_choice="required" needs at least one tool')
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class _RequiredArray(MistralParser):
    """The "required" array: Mistral's walk, started after the marker, with no content."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._skip_marker()

    def _content(self, text: str) -> None:
        pass  # the grammar leaves no room for text; anything stray is dropped, not shown


class ForcedToolCallParser(ToolCallParser):
    """Reads a grammar-forced output: `named` -> one call whose arguments are the whole
    output; None ("required") -> the array of calls."""

    def __init__(self, tools: list[ToolSpec], named: str | None) -> None:
        super().__init__(tools)
        self._named = named
        self._array = _RequiredArray(tools) if named is None else None
        self._announced = False
        self._value = ValueScanner()

    def feed(self, delta: str) -> StreamDelta:
        if self._array is not None:
            return self._array.feed(delta)
        out = StreamDelta()
        self._announce(out)
        pos = 0
        if not self._value.first:
            pos = skip_whitespace(delta, 0)
        if pos < len(delta) and not self._value.done:
            end = self._value.feed(delta, pos)
            if end > pos:
                out.calls.append(ToolCallDelta(index=0, arguments=delta[pos:end]))
        return out

    def finish(self) -> StreamDelta:
        if self._array is not None:
            return self._array.finish()
        out = StreamDelta()
        self._announce(out)  # an empty output is still the forced call
        return out

    def _announce(self, out: StreamDelta) -> None:
        if not self._announced:
            assert self._named is not None
            out.calls.append(ToolCallDelta(index=0, name=self._named))
            self._announced = True
