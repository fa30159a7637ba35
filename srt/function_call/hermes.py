"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2.5 and Qwen3 (and NousResearch Hermes) chat templates ask the model to wrap each call in
these tags, as plain text (they are not special tokens). Several blocks may follow each other
(parallel calls), with text before, between and after them:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

Rules of this parser:
- Content is streamed up to the point where it could be the start of `<tool_call>`.
- Whitespace inside a block, and the whitespace right after a call (up to the next non-blank
  text or the next block) is dropped, so the newlines between blocks do not show up as
  content. Content before the first block is kept as written.
- A block whose JSON is malformed or names an unknown function is content, tags included.
- A missing `</tool_call>` is tolerated: text after the object is content (blanks dropped).
- A committed call whose JSON then goes wrong keeps the arguments sent so far; the rest of
  its block, up to `</tool_call>`, is dropped.
"""

from __future__ import annotations

from srt.function_call.core import ToolSpec
from srt.function_call.json_scan import partial_start, skip_whitespace
from srt.function_call.walker import CallOutcome, TextWalk

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

# Modes: plain text; after <tool_call>; reading the object; after it (expecting the close
# tag); dropping the rest of a broken block; dropping blanks after a call.
_CONTENT, _OPEN, _CALL, _CLOSE, _SKIP, _AFTER = range(6)


class HermesParser(TextWalk):
    """`<tool_call>` blocks, each one JSON call object (see the module docstring)."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._mode = _CONTENT

    def _step(self, text: str, pos: int) -> int:
        mode = self._mode
        if mode == _CONTENT:
            end = self._content_until(text, pos, OPEN_TAG)
            if end < 0:
                return len(text)
            self._mode = _OPEN
            return end
        if mode == _OPEN:
            j = skip_whitespace(text, pos)
            self._hold(text[pos:j])
            if j < len(text):
                if text[j] == "{":
                    self._start_call()
                    self._mode = _CALL
                else:
                    self._reject()
                    self._mode = _CONTENT
            return j
        if mode == _CALL:
            end, outcome = self._advance_call(text, pos)
            if outcome is CallOutcome.REJECTED:
                self._mode = _CONTENT
            elif outcome is not CallOutcome.READING:
                self._mode = _SKIP if outcome is CallOutcome.MALFORMED else _CLOSE
            return end
        if mode == _CLOSE:
            j = skip_whitespace(text, pos)
            if j == len(text):
                return j
            if text.startswith(CLOSE_TAG, j):
                self._mode = _AFTER
                return j + len(CLOSE_TAG)
            if CLOSE_TAG.startswith(text[j:]):
                self._carry = text[j:]
                return len(text)
            self._mode = _CONTENT  # no close tag: what follows is text (or the next block)
            return j
        if mode == _SKIP:
            i = text.find(CLOSE_TAG, pos)
            if i < 0:
                self._carry = text[partial_start(text, pos, CLOSE_TAG) :]
                return len(text)
            self._mode = _AFTER
            return i + len(CLOSE_TAG)
        j = skip_whitespace(text, pos)  # _AFTER
        if j < len(text):
            self._mode = _CONTENT
        return j

    def _end(self, carry: str) -> None:
        if self._mode == _CONTENT:
            self._content(carry)
        elif self._pending_call():
            self._reject()
        # Otherwise: a call cut off (it keeps what was sent), or a partial close tag.
