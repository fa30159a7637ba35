"""Reasoning in model output: `<think>...</think>` split off into `reasoning_content`.

`--reasoning-parser NAME` (`REASONING_PARSERS`) picks how a model marks its thinking:

- `deepseek-r1`: the output starts inside the reasoning (the chat template opened `<think>`);
  an opening `<think>` the model writes anyway is dropped, and `</think>` ends the reasoning.
  Output that never closes it is all reasoning.
- `qwen3`: reasoning only when the output starts with `<think>` (leading whitespace allowed);
  otherwise it is all content (thinking off, e.g. `enable_thinking: false`).

Like the tool-call parsers, a parser walks one choice's output delta by delta (`feed`, then
`finish`), holding back text that may be the start of a marker; `parse` is the same walk over
a whole text. This module imports no torch.

Whitespace: the reasoning is stripped at both ends (its trailing blanks are held back until
non-blank reasoning follows), and the blanks right after `</think>` (models write
`</think>\n\n`) are dropped from the start of the content. `parse` answers None for the
reasoning when it is empty -- exactly when a stream sent no reasoning delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from srt.function_call.json_scan import partial_start, skip_whitespace
from srt.utils.registry import Registry

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

# Modes: before anything (is there an opening tag?); blanks at the start of the reasoning; in
# the reasoning; blanks after </think>; content.
_START, _REASONING_LEAD, _REASONING, _CONTENT_LEAD, _CONTENT = range(5)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningParser:
    """One instance per choice. A subclass says only where the output starts: inside the
    reasoning (`starts_in_reasoning`), or inside it only after an opening `<think>`."""

    starts_in_reasoning: ClassVar[bool]

    def __init__(self) -> None:
        self._mode = _START
        self._carry = ""  # an undecided tail (a partial tag), read again with the next delta
        self._lead = ""  # blanks before anything else: content or dropped, once known
        self._blanks = ""  # reasoning blanks held back: trailing, unless more reasoning follows
        self._out = ReasoningDelta()

    def feed(self, delta: str) -> ReasoningDelta:
        text = self._carry + delta
        self._carry = ""
        self._out = ReasoningDelta()
        pos = 0
        while pos < len(text):
            pos = self._step(text, pos)
        return self._out

    def finish(self) -> ReasoningDelta:
        self._out = ReasoningDelta()
        carry, self._carry = self._carry, ""
        if self._mode == _START:
            if self.starts_in_reasoning:
                self._reasoning(carry)
            else:
                self._out.content += self._lead + carry
        elif self._mode in (_REASONING_LEAD, _REASONING):
            self._reasoning(carry)  # a partial `</think>`: never closed, so it is reasoning
        return self._out

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole output -> (reasoning, or None when there was none; content)."""
        out = self.feed(text)
        out.extend(self.finish())
        return out.reasoning or None, out.content

    def _reasoning(self, text: str) -> None:
        """Send reasoning text, holding back its trailing blanks."""
        body = text.rstrip(" \t\r\n")
        if body:
            self._out.reasoning += self._blanks + body
            self._blanks = text[len(body) :]
        else:
            self._blanks += text

    def _step(self, text: str, pos: int) -> int:
        mode = self._mode
        if mode == _CONTENT:
            self._out.content += text[pos:]
            return len(text)
        if mode == _REASONING:
            i = text.find(CLOSE_TAG, pos)
            if i < 0:
                cut = partial_start(text, pos, CLOSE_TAG)
                self._reasoning(text[pos:cut])
                self._carry = text[cut:]
                return len(text)
            self._reasoning(text[pos:i])
            self._blanks = ""
            self._mode = _CONTENT_LEAD
            return i + len(CLOSE_TAG)
        j = skip_whitespace(text, pos)
        if mode == _START:
            self._lead += text[pos:j]
            if j == len(text):
                return j
            if text.startswith(OPEN_TAG, j):
                self._mode = _REASONING_LEAD
                return j + len(OPEN_TAG)
            if OPEN_TAG.startswith(text[j:]):
                self._carry = text[j:]
                return len(text)
            if self.starts_in_reasoning:
                self._mode = _REASONING
            else:
                self._out.content += self._lead
                self._mode = _CONTENT
            return j
        if j < len(text):  # _REASONING_LEAD or _CONTENT_LEAD: blanks dropped
            self._mode = _REASONING if mode == _REASONING_LEAD else _CONTENT
        return j


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the chat template opens `<think>`, so the output starts in the reasoning."""

    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with `<think>` (thinking may be off)."""

    starts_in_reasoning = False


REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser")
REASONING_PARSERS.register("deepseek-r1", "srt.reasoning_parser:DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", "srt.reasoning_parser:Qwen3ReasoningParser")
