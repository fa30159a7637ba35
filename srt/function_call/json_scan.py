"""Incremental JSON scanning for the tool-call parsers: each character is looked at once.

A tool call's text arrives a few characters at a time. Re-parsing the whole text on every delta
would cost quadratic time in the output length, so the scanners here keep the state that
matters between deltas -- inside a string or not, after a backslash or not, the stack of open
brackets -- and resume from where the previous delta stopped. Runs of plain characters are
skipped with a compiled regex, so the per-character Python work is only at quotes, escapes
and brackets.

- `ValueScanner` follows one JSON value (object, array, string or scalar) to its end. It
  checks bracket matching and scalar spelling, not the full grammar inside nested values: the
  parsers pass argument text through as the model wrote it, they do not rebuild it.
- `ObjectScanner` follows the top level of one object strictly (keys, colons, commas) and
  records the raw text of chosen members' values ("slots"), e.g. the "name" and "arguments"
  of a call. It returns to its caller whenever a slot's value starts or completes, so the
  caller decides at the same character whether the text came in one delta or in many.

Both are fed `(text, pos)`: they consume from `text[pos:]` and return the position after the
last character they consumed. On an error they stop *before* the offending character and set
`error` (and `done`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

_STRING_STOP = re.compile(r'["\\]')  # what ends a run of plain characters in a string
_NESTED_STOP = re.compile(r'["{}\[\]]')  # ... outside strings, inside an object or array
_SCALAR_END = re.compile(r"[\s,}\]]")
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_CLOSER = {"{": "}", "[": "]"}


def skip_whitespace(text: str, pos: int) -> int:
    """The position of the first non-whitespace character at or after `pos` (or len)."""
    match = _WHITESPACE.match(text, pos)
    assert match is not None  # `*` always matches
    return match.end()


def partial_start(text: str, pos: int, marker: str) -> int:
    """Where the longest tail of `text[pos:]` that could still grow into `marker` begins.

    That tail must be held back: the next delta decides whether it is a marker or text.
    Returns len(text) when no tail is a proper prefix of `marker`.
    """
    i = text.find(marker[0], max(pos, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return i
        i = text.find(marker[0], i + 1)
    return len(text)


class ValueScanner:
    """One JSON value, from its first character (not whitespace) to its last."""

    __slots__ = ("_escape", "_in_string", "_scalar", "_stack", "done", "error", "first")

    def __init__(self) -> None:
        self.first = ""  # the value's first character: "{", "[", '"' or a scalar's
        self.done = False
        self.error = False
        self._stack: list[str] = []  # the closers still expected, innermost last
        self._in_string = False
        self._escape = False
        self._scalar: list[str] | None = None  # the text of a scalar value so far

    def begin(self, char: str) -> int:
        """Start the value at `char`; how many characters that consumed (0 for a scalar,
        whose characters `feed` collects)."""
        self.first = char
        if char in _CLOSER:
            self._stack.append(_CLOSER[char])
            return 1
        if char == '"':
            self._in_string = True
            return 1
        self._scalar = []
        return 0

    def feed(self, text: str, pos: int) -> int:
        n = len(text)
        if not self.first:
            if pos >= n:
                return pos
            pos += self.begin(text[pos])
        if self._scalar is not None:
            # A scalar ends at a delimiter it does not own (so at the end of the text it is
            # not known to be complete: "12" may become "123").
            match = _SCALAR_END.search(text, pos)
            end = match.start() if match else n
            self._scalar.append(text[pos:end])
            if match:
                self.done = True
                self.error = _SCALAR.fullmatch("".join(self._scalar)) is None
            return end
        while pos < n:
            if self._escape:
                self._escape = False
                pos += 1
                continue
            if self._in_string:
                match = _STRING_STOP.search(text, pos)
                if match is None:
                    return n
                pos = match.end()
                if match.group() == "\\":
                    self._escape = True
                    continue
                self._in_string = False
                if not self._stack:  # the value was a string
                    self.done = True
                    return pos
                continue
            match = _NESTED_STOP.search(text, pos)
            if match is None:
                return n
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char in _CLOSER:
                self._stack.append(_CLOSER[char])
            elif self._stack.pop() != char:
                self.done = self.error = True
                return match.start()
            elif not self._stack:
                self.done = True
                return match.end()
            pos = match.end()
        return n


# ObjectScanner states: where in `{ "key" : value , ... }` the next character falls.
_START, _KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(8)


class ObjectScanner:
    """The top level of one JSON object, with the raw value text of the members in `capture`.

    `capture` maps a member key to a slot name; several keys may share a slot (aliases such
    as "arguments" and "parameters"), and a slot takes the first such member only.
    """

    def __init__(self, capture: Mapping[str, str]) -> None:
        self.done = False
        self.error = False
        self._capture = capture
        self._state = _START
        self._key: list[str] = []
        self._key_escape = False
        self._member = ""  # the key of the member being read
        self._value: ValueScanner | None = None
        self._slot: str | None = None  # the slot the current value fills, if any
        self._chunks: dict[str, list[str]] = {}
        self._taken: dict[str, int] = {}
        self._first: dict[str, str] = {}
        self._complete: set[str] = set()

    # -- what the caller reads ---------------------------------------------------------------

    def started(self, slot: str) -> bool:
        return slot in self._chunks

    def first(self, slot: str) -> str:
        """The first character of the slot's value ("" before it starts)."""
        return self._first.get(slot, "")

    def complete(self, slot: str) -> bool:
        return slot in self._complete

    def text(self, slot: str) -> str:
        """The slot's raw value text so far."""
        return "".join(self._chunks.get(slot, ()))

    def take(self, slot: str) -> str:
        """The slot's raw value text that arrived since the previous `take`."""
        chunks = self._chunks.get(slot)
        if chunks is None:
            return ""
        start = self._taken.get(slot, 0)
        self._taken[slot] = len(chunks)
        return "".join(chunks[start:])

    # -- the walk -----------------------------------------------------------------------------

    def _fail(self, pos: int) -> int:
        self.done = self.error = True
        return pos

    def feed(self, text: str, pos: int) -> int:
        """Consume `text[pos:]` until the object ends, an error, the end of the text, or a
        slot's value starting or completing; return the position reached."""
        n = len(text)
        while pos < n and not self.done:
            state = self._state
            if state == _VALUE:
                value = self._value
                assert value is not None
                end = value.feed(text, pos)
                if self._slot is not None:
                    self._chunks[self._slot].append(text[pos:end])
                pos = end
                if not value.done:
                    return pos
                if value.error:
                    return self._fail(pos)
                self._state = _AFTER_VALUE
                if self._slot is not None:
                    self._complete.add(self._slot)
                    self._slot = None
                    return pos
                continue
            if state == _KEY:
                pos = self._read_key(text, pos)
                continue
            char = text[pos]
            if char in " \t\r\n":
                pos += 1
            elif state == _START:
                if char != "{":
                    return self._fail(pos)
                self._state = _KEY_OR_END
                pos += 1
            elif state in (_KEY_OR_END, _KEY_START):
                if char == "}" and state == _KEY_OR_END:
                    self.done = True
                elif char == '"':
                    self._state = _KEY
                else:
                    return self._fail(pos)
                pos += 1
            elif state == _COLON:
                if char != ":":
                    return self._fail(pos)
                self._state = _VALUE_START
                pos += 1
            elif state == _VALUE_START:
                pos = self._begin_value(text, pos)
                if self._slot is not None:
                    return pos
            else:  # _AFTER_VALUE
                if char == ",":
                    self._state = _KEY_START
                elif char == "}":
                    self.done = True
                else:
                    return self._fail(pos)
                pos += 1
        return pos

    def _read_key(self, text: str, pos: int) -> int:
        if self._key_escape:
            self._key_escape = False
            self._key.append(text[pos])
            return pos + 1
        match = _STRING_STOP.search(text, pos)
        if match is None:
            self._key.append(text[pos:])
            return len(text)
        self._key.append(text[pos : match.end()])
        if match.group() == "\\":
            self._key_escape = True
            return match.end()
        raw = '"' + "".join(self._key)
        self._key = []
        try:
            self._member = json.loads(raw)
        except ValueError:
            return self._fail(match.start())
        self._state = _COLON
        return match.end()

    def _begin_value(self, text: str, pos: int) -> int:
        value = self._value = ValueScanner()
        used = value.begin(text[pos])
        self._state = _VALUE
        slot = self._capture.get(self._member)
        if slot is None or slot in self._chunks:
            self._slot = None
            return pos + used
        self._slot = slot
        self._chunks[slot] = [text[pos : pos + used]]
        self._first[slot] = text[pos]
        return pos + used
