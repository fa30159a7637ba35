"""Reasoning parsers (deepseek-r1, qwen3): canned outputs -> (reasoning, content).

As for the tool-call parsers, every canned text is also streamed, split at every position and
one character at a time, and must give what `parse` gives.
"""

from __future__ import annotations

import pytest

from srt.reasoning_parser import REASONING_PARSERS, ReasoningDelta

R1_CASES = {
    "template opened think": ("Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    "model writes think anyway": ("<think>\nhmm, 2+2\n\n</think>\n\n4", "hmm, 2+2", "4"),
    "never closed": ("still thinking <thi", "still thinking <thi", ""),
    "marker prefix inside": ("a </thin> b</think>c", "a </thin> b", "c"),
    "empty reasoning": ("</think>\n\nHi", None, "Hi"),
    "blank output": ("  \n", None, ""),
    "think later is text": ("x <think> y</think>z", "x <think> y", "z"),
    "content keeps its tags": ("r</think>a </think> b\n", "r", "a </think> b\n"),
}
QWEN3_CASES = {
    "thinking": ("<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
    "leading blanks": ("\n <think>plan</think>answer", "plan", "answer"),
    "thinking off": ("  The answer is 4.", None, "  The answer is 4."),
    "think later is content": ("Hi <think>x</think>", None, "Hi <think>x</think>"),
    "never closed": ("<think>plan and </thi", "plan and </thi", ""),
    "partial open tag": ("<thin", None, "<thin"),
    "empty think": ("<think>\n\n</think>\n\nanswer", None, "answer"),
}


def stream(name: str, pieces: list[str]) -> tuple[str | None, str]:
    parser = REASONING_PARSERS.create(name)
    total = ReasoningDelta()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total.reasoning or None, total.content


def check(name: str, text: str, reasoning: str | None, content: str) -> None:
    assert REASONING_PARSERS.create(name).parse(text) == (reasoning, content)
    assert stream(name, list(text)) == (reasoning, content)
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]]) == (reasoning, content), i


@pytest.mark.parametrize("case", sorted(R1_CASES))
def test_deepseek_r1(case: str) -> None:
    check("deepseek-r1", *R1_CASES[case])


@pytest.mark.parametrize("case", sorted(QWEN3_CASES))
def test_qwen3(case: str) -> None:
    check("qwen3", *QWEN3_CASES[case])


def test_streams_as_soon_as_known() -> None:
    parser = REASONING_PARSERS.create("qwen3")
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nk>\nStep one. ") == ReasoningDelta(reasoning="Step one.")
    # The blank is held back (it may be trailing), then sent with the next words.
    assert parser.feed("Two.</") == ReasoningDelta(reasoning=" Two.")
    assert parser.feed("think>\n\nDone") == ReasoningDelta(content="Done")
    assert parser.finish() == ReasoningDelta()


def test_content_is_not_held_without_reasoning() -> None:
    parser = REASONING_PARSERS.create("qwen3")
    assert parser.feed("Hello") == ReasoningDelta(content="Hello")
    assert parser.feed(" <think>") == ReasoningDelta(content=" <think>")
