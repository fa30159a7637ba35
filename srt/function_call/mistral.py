"""Mistral tool calls: `[TOOL_CALLS]` followed by a JSON array of call objects.

Mistral's instruct models (v0.3 tokenizer and later) write content, then the `[TOOL_CALLS]`
special token and the calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}},
                  {"name": "get_weather", "arguments": {"city": "Rome"}}]

Rules of this parser:
- Content is streamed up to the point where it could be the start of `[TOOL_CALLS]`.
- A single object instead of the array is accepted. "parameters" is accepted for "arguments".
- An element that names an unknown function or is malformed is content, from the marker (first
  element) or from its `,` (later elements) on; the text after it is scanned as content again.
- Blanks after the array are dropped; other text after it is content.
"""

from __future__ import annotations

from srt.function_call.core import ToolSpec
from srt.function_call.json_scan import skip_whitespace
from srt.function_call.walker import CallOutcome, TextWalk

MARKER = "[TOOL_CALLS]"

# Modes: plain text; after the marker (expecting `[` or `{`); at an element (expecting `{` or
# `]`); reading a call; after an element (expecting `,` or `]`); dropping blanks after calls.
_CONTENT, _OPEN, _ELEMENT, _CALL, _SEP, _AFTER = range(6)


class MistralParser(TextWalk):
    """`[TOOL_CALLS]` + a JSON array of calls (see the module docstring)."""

    needs_special_tokens = True  # [TOOL_CALLS]

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._mode = _CONTENT
        self._single = False  # the calls are one bare object, not an array

    def _skip_marker(self) -> None:
        """Start as if `[TOOL_CALLS]` had just been read (the forced "required" array)."""
        self._held = []
        self._mode = _OPEN

    def _step(self, text: str, pos: int) -> int:
        mode = self._mode
        if mode == _CONTENT:
            end = self._content_until(text, pos, MARKER)
            if end < 0:
                return len(text)
            self._mode = _OPEN
            return end
        if mode == _CALL:
            end, outcome = self._advance_call(text, pos)
            if outcome is CallOutcome.REJECTED:
                self._mode = _CONTENT
            elif outcome is not CallOutcome.READING:
                self._mode = _AFTER if self._single else _SEP
            return end
        j = skip_whitespace(text, pos)
        if mode in (_OPEN, _ELEMENT):
            self._hold(text[pos:j])
            if j == len(text):
                return j
            char = text[j]
            if char == "{":
                self._single = mode == _OPEN
                self._start_call()
                self._mode = _CALL
                return j
            if char == "[" and mode == _OPEN:
                self._hold(char)
                self._mode = _ELEMENT
                return j + 1
            if char == "]" and mode == _ELEMENT:  # an empty array, or a trailing comma
                self._held = None
                self._mode = _AFTER
                return j + 1
            self._reject()
            self._mode = _CONTENT
            return j
        if j < len(text):
            if mode == _SEP and text[j] == ",":
                self._held = [","]
                self._mode = _ELEMENT
                return j + 1
            if mode == _SEP and text[j] == "]":
                self._mode = _AFTER
                return j + 1
            self._mode = _CONTENT
        return j

    def _end(self, carry: str) -> None:
        if self._mode == _CONTENT:
            self._content(carry)
        elif self._pending_call():
            self._reject()
