"""Nested request fields of the chat route (a message, its content parts, `stream_options`):
each is honoured, a documented no-op, or refused with a 400 naming `messages` or the option
(`srt/entrypoints/openai/fields.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from srt.entrypoints.openai import fields
from srt.entrypoints.openai.fields import Treatment
from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error, sent_fields, without_rid

ASSISTANT = {"role": "assistant", "content": "Hi!"}


def _chat(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [*messages, {"role": "user", "content": "Fields"}]}


@pytest.mark.parametrize(
    ("extra", "plain"),
    [
        (_chat({**ASSISTANT, "refusal": None}), _chat(ASSISTANT)),
        (_chat({**ASSISTANT, "refusal": "I can't."}), _chat(ASSISTANT)),
        (
            _chat({"role": "user", "content": [{"type": "text", "text": "a",
                                                "prompt_cache_breakpoint": {}}]}),
            _chat({"role": "user", "content": [{"type": "text", "text": "a"}]}),
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
            {"stream": True, "stream_options": {"include_usage": True}},
        ),
    ],
)  # fmt: skip
def test_nested_no_ops(
    base_url: str, tm: FakeTokenizerManager, extra: dict[str, Any], plain: dict[str, Any]
) -> None:
    resp, received = sent_fields(base_url, tm, CHAT, extra)
    assert resp.status_code == 200, resp.text
    _, expected = sent_fields(base_url, tm, CHAT, plain)
    assert [without_rid(o) for o in received] == [without_rid(o) for o in expected]


def _part(kind: str) -> dict[str, Any]:
    payload = {"image_url": {"url": "http://x/y.png"}, "input_audio": {"data": "", "format": "wav"},
               "file": {"file_id": "f"}, "refusal": "no"}[kind]  # fmt: skip
    return {"type": kind, kind: payload}


NESTED_REFUSED = [
    (_chat({**ASSISTANT, "audio": {"id": "a1"}}), "`audio`"),
    (_chat({**ASSISTANT, "function_call": {"name": "f", "arguments": "{}"}}), "use tool_calls"),
    (_chat({"role": "user", "content": "x", "color": "red"}), "Unrecognized request field"),
    (_chat({"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}), "`x`"),
    *[
        (_chat({"role": "user", "content": [_part(kind)]}), f"`{kind}`")
        for kind, rule in fields.CONTENT_PART_TYPES.items()
        if rule.treatment is Treatment.REFUSED
    ],
]


@pytest.mark.parametrize(("extra", "needle"), NESTED_REFUSED)
def test_nested_refusals_name_messages(
    base_url: str, tm: FakeTokenizerManager, extra: dict[str, Any], needle: str
) -> None:
    resp, received = sent_fields(base_url, tm, CHAT, extra)
    error = assert_error(resp, 400, "messages")
    assert needle in error["message"] and error["message"].startswith("messages.0")
    assert not received


def test_stream_options_unknown_field(base_url: str, tm: FakeTokenizerManager) -> None:
    extra = {"stream": True, "stream_options": {"include_usage": True, "verbose": True}}
    error = assert_error(sent_fields(base_url, tm, COMPLETIONS, extra)[0], 400, "stream_options")
    assert "verbose" in error["message"]
