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
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.utils.registry import Registry


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One instance per choice. (Implementation: see the subclasses below.)"""

    def feed(self, delta: str) -> ReasoningDelta:
        raise NotImplementedError

    def finish(self) -> ReasoningDelta:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole output -> (reasoning, or None when there was none; content)."""
        raise NotImplementedError


REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser")
REASONING_PARSERS.register("deepseek-r1", "srt.reasoning_parser:DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", "srt.reasoning_parser:Qwen3ReasoningParser")
