"""Llama 3.1 / 3.2 JSON tool calls: the whole output is the calls.

With tools in the prompt, Llama 3.1/3.2 answer either in text or -- from the first character
-- with a call object, optionally after the `<|python_tag|>` special token:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by `;` (whitespace around it allowed; a `{` right after a call
is taken as the next call too). The key "arguments" is accepted for "parameters".

Rules of this parser:
- Output that, after leading whitespace, starts with neither `<|python_tag|>` nor `{` is all
  content (held back only while it could still be `<|python_tag|>`).
- A candidate call that names an unknown function or is malformed makes it, and everything
  after it, content; calls committed before it stay calls.
- After the last call, blanks are dropped; other text after a call is content.
"""

from __future__ import annotations

from srt.function_call.core import ToolSpec
from srt.function_call.json_scan import skip_whitespace
from srt.function_call.walker import CallOutcome, TextWalk

PYTHON_TAG = "<|python_tag|>"

# Modes: before anything; after the tag (expecting `{`); reading a call; after a call
# (expecting `;`, `{` or the end); after `;` (expecting `{`); the rest is content.
_LEAD, _TAGGED, _CALL, _SEP, _NEXT, _CONTENT = range(6)


class Llama3JsonParser(TextWalk):
    """Llama 3.x JSON calls (see the module docstring)."""

    needs_special_tokens = True  # <|python_tag|>

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._mode = _LEAD
        self._held = []  # leading whitespace, until the output shows what it is

    def _step(self, text: str, pos: int) -> int:
        mode = self._mode
        if mode == _CONTENT:
            self._content(text[pos:])
            return len(text)
        if mode == _CALL:
            end, outcome = self._advance_call(text, pos)
            if outcome is CallOutcome.REJECTED:
                self._mode = _CONTENT
            elif outcome is not CallOutcome.READING:
                self._mode = _SEP
            return end
        j = skip_whitespace(text, pos)
        if mode == _SEP:
            if j == len(text):
                return j
            if text[j] == ";":
                self._held = [";"]
                self._mode = _NEXT
                return j + 1
            if text[j] == "{":
                self._held = []
                self._start_call()
                self._mode = _CALL
                return j
            self._mode = _CONTENT  # text after the calls; the blanks before it are dropped
            return j
        self._hold(text[pos:j])
        if j == len(text):
            return j
        if mode == _LEAD:
            if text.startswith(PYTHON_TAG, j):
                self._hold(PYTHON_TAG)
                self._mode = _TAGGED
                return j + len(PYTHON_TAG)
            if PYTHON_TAG.startswith(text[j:]):
                self._carry = text[j:]
                return len(text)
        if text[j] == "{":
            self._start_call()
            self._mode = _CALL
        else:
            self._reject()
            self._mode = _CONTENT
        return j

    def _end(self, carry: str) -> None:
        if self._pending_call():
            self._hold(carry)
            self._reject()
