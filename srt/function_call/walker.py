"""What the format parsers share: reading one call object, and the walk over text deltas.

`CallReader` turns one `{"name": ..., "arguments": {...}}` object into call deltas. The text
of a candidate call is held back by the walk until the reader *commits* -- its name string is
complete and names one of the request's tools -- and from then on it is a call, whatever
follows:

- commit: one `ToolCallDelta(name=...)`, then the arguments text already read (when the model
  put "arguments" before "name"), then each new piece of it as it arrives;
- reject (before a commit): the name is unknown or not a string, the arguments value is not
  an object, or the JSON is malformed / closes without a name. The walk returns the held text
  as content;
- after a commit, a JSON error or the end of the output leaves the call with the argument
  text sent so far (`malformed` tells the walk to resynchronise). An object that closes
  without an arguments member gets "{}".

`TextWalk` is the base of the format parsers: a mode machine stepping through
`carry + delta`, where `carry` is a short undecided tail (a partial marker) kept from the
previous delta. Every decision depends only on characters already read, so one delta or many
give the same result.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Container
from enum import Enum

from srt.function_call.core import StreamDelta, ToolCallDelta, ToolCallParser, ToolSpec
from srt.function_call.json_scan import ObjectScanner, partial_start

ARGUMENT_KEYS = ("arguments", "parameters")  # every format's key, accepted by all of them


class CallReader:
    """One call object, from its `{`; see the module docstring for commit and reject."""

    def __init__(self, tools: Container[str], index: int) -> None:
        capture = {"name": "name"} | {key: "args" for key in ARGUMENT_KEYS}
        self._scan = ObjectScanner(capture)
        self._tools = tools
        self.index = index
        self.committed = False
        self.rejected = False
        self.malformed = False  # committed, then the JSON went wrong
        self.done = False
        self._bad_args = False  # the arguments value is not an object

    def feed(self, text: str, pos: int, out: list[ToolCallDelta]) -> int:
        """Read from `text[pos:]` until the object is done or the text ends; the arguments
        read meanwhile go out as one fragment."""
        scan = self._scan
        while True:
            pos = scan.feed(text, pos)
            self._react(out)
            if self.done or pos >= len(text):
                break
        if self.committed and not self._bad_args:
            piece = scan.take("args")
            if piece:
                out.append(ToolCallDelta(index=self.index, arguments=piece))
            if scan.done and not scan.error and not scan.started("args"):
                out.append(ToolCallDelta(index=self.index, arguments="{}"))
        return pos

    def _react(self, out: list[ToolCallDelta]) -> None:
        """Decide at each stop of the scanner (a slot starting or ending, the object's end)."""
        scan = self._scan
        self._bad_args = scan.started("args") and scan.first("args") != "{"
        if not self.committed:
            name = _string_value(scan.text("name")) if scan.complete("name") else None
            if self._bad_args or name is not None and name not in self._tools:
                self.rejected = self.done = True
            elif name is not None:
                self.committed = True
                out.append(ToolCallDelta(index=self.index, name=name))
            elif scan.done:  # malformed, or closed with no name
                self.rejected = self.done = True
            return
        if self._bad_args or scan.done:
            self.done = True
            self.malformed = self._bad_args or scan.error


def _string_value(raw: str) -> str:
    """A complete value's text -> the string it spells, or "" (never a tool name) when it is
    not a JSON string."""
    try:
        value = json.loads(raw)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


class CallOutcome(Enum):
    READING = "reading"  # the call object goes on in the next delta
    REJECTED = "rejected"  # not a call after all: its text became content
    DONE = "done"  # a committed call, its object closed
    MALFORMED = "malformed"  # a committed call whose JSON broke off: resynchronise


class TextWalk(ToolCallParser):
    """Base of the format parsers: `_step` advances one mode at a time through the text."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._carry = ""  # an undecided tail of the previous delta, read again with the next
        self._held: list[str] | None = None  # text of a call not yet committed
        self._reader: CallReader | None = None
        self._ncalls = 0
        self._out = StreamDelta()

    def feed(self, delta: str) -> StreamDelta:
        text = self._carry + delta
        self._carry = ""
        self._out = StreamDelta()
        pos = 0
        while pos < len(text):
            pos = self._step(text, pos)
        return self._out

    def finish(self) -> StreamDelta:
        self._out = StreamDelta()
        carry, self._carry = self._carry, ""
        self._end(carry)
        return self._out

    @abstractmethod
    def _step(self, text: str, pos: int) -> int:
        """Advance from `pos` (consuming at least one character, or setting `_carry` to the
        rest and returning len(text)); return the new position."""

    @abstractmethod
    def _end(self, carry: str) -> None:
        """The output ended: settle the current mode (`carry` is the undecided tail)."""

    # -- helpers for the subclasses -------------------------------------------------------

    def _content(self, text: str) -> None:
        if text:
            self._out.content += text

    def _hold(self, text: str) -> None:
        assert self._held is not None
        self._held.append(text)

    def _start_call(self) -> None:
        """The next character is the `{` of a candidate call (its prefix is in `_held`)."""
        self._reader = CallReader(self.tools, self._ncalls)

    def _content_until(self, text: str, pos: int, marker: str) -> int:
        """Content mode: the text up to `marker` is content; a partial marker at the end is
        carried to the next delta. Returns the position after the marker (whose text is
        held, as the start of a candidate call), or -1 when the text ended first."""
        i = text.find(marker, pos)
        if i < 0:
            cut = partial_start(text, pos, marker)
            self._content(text[pos:cut])
            self._carry = text[cut:]
            return -1
        self._content(text[pos:i])
        self._held = [marker]
        return i + len(marker)

    def _advance_call(self, text: str, pos: int) -> tuple[int, CallOutcome]:
        """Read on in the current call: (new position, what became of it). A rejected
        candidate's text is content by now; a finished call's reader is released."""
        end = self._read_call(text, pos)
        reader = self._reader
        assert reader is not None
        if reader.rejected:
            self._reject()
            return end, CallOutcome.REJECTED
        if not reader.done:
            return end, CallOutcome.READING
        self._reader = None
        return end, CallOutcome.MALFORMED if reader.malformed else CallOutcome.DONE

    def _read_call(self, text: str, pos: int) -> int:
        """Feed the current reader; while uncommitted, keep what it read in `_held`."""
        reader = self._reader
        assert reader is not None
        end = reader.feed(text, pos, self._out.calls)
        if self._held is not None:
            if reader.committed:  # it is a call: the held text was its markup
                self._held = None
                self._ncalls += 1
            else:
                self._held.append(text[pos:end])
        return end

    def _reject(self) -> None:
        """The candidate was not a call: its text is content after all."""
        if self._held is not None:
            self._content("".join(self._held))
        self._held = None
        self._reader = None

    def _pending_call(self) -> bool:
        """Whether a candidate call is held (not committed) -- at the end it becomes content."""
        return self._held is not None
