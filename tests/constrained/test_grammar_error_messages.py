"""Grammar errors go back to clients short and clean: no xgrammar log
prefixes, C++ source paths or assertion text, no echo of the schema, at most a few hundred
characters. No model needed: xgrammar's own errors are cleaned, then the queue's message."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import xgrammar as xgr

from constrained.base_grammar_backend import GrammarError
from constrained.xgrammar_backend import _compiler_message
from managers.scheduler.grammar_queue import MAX_MESSAGE_CHARS, GrammarQueue

DEPTH = 5000
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * DEPTH + '{"type": 7}' + "}}" * DEPTH


def _xgrammar_error(spec: str) -> RuntimeError:
    with pytest.raises(RuntimeError) as err:
        xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    return err.value


def assert_clean(message: str) -> None:
    for internal in (".cc:", ".h:", "/project/", "Check failed", "The JSON string is"):
        assert internal not in message, message


def test_deep_schema_message_is_short_and_clean() -> None:
    raw = _xgrammar_error(DEEP_SCHEMA)
    assert len(str(raw)) > 100_000  # xgrammar echoes the whole schema
    message = _compiler_message(raw)
    assert_clean(message)
    assert "recursion depth" in message and len(message) < 300, message


def test_syntax_error_keeps_the_compiler_words() -> None:
    message = _compiler_message(_xgrammar_error("{not json"))
    assert_clean(message)
    assert message.startswith("Failed to parse JSON: syntax error"), message


class _Req:
    finished_reason = None
    grammar = None


@pytest.mark.parametrize(
    "error",
    [
        GrammarError("bad " * 10_000),
        RuntimeError("failed in /opt/lib/python3.11/site-packages/x/compiler.py:88 " * 100),
    ],
)
def test_queue_caps_and_strips_messages(error: Exception) -> None:
    future: Future[object] = Future()
    future.set_exception(error)
    queue = GrammarQueue(timeout_s=60)
    req = _Req()
    queue.add(req, future)  # type: ignore[arg-type]
    ready, failed = queue.pop_done(lambda compiled: compiled, block=False)
    assert ready == [] and failed == [req]
    reason = req.finished_reason
    assert reason is not None and reason.status_code == 400
    assert len(reason.message) <= MAX_MESSAGE_CHARS + 40
    assert "/opt/lib" not in reason.message and "compiler.py" not in reason.message
