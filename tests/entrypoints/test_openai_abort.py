"""OpenAI routes and aborts: an abort that carries no status code (an
operator's `/abort_request`, a request the KV pool cannot hold) is a 200 with the text so far
and `finish_reason: "abort"`, or a stream's last chunk before `[DONE]`; an abort with a status
code stays an error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from managers.errors import RequestError
from srt.entrypoints.openai.serving_utils import finish_reason
from tests.entrypoints.fake_tokenizer_manager import TRIGGER_ABORT, FakeTokenizerManager
from tests.entrypoints.helpers import post, serve_openai_routes, sse_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _out(reason: dict[str, Any] | None) -> dict[str, Any]:
    return {"text": "ab", "meta_info": {"finish_reason": reason}}


def test_finish_reason_of_a_plain_abort_is_abort() -> None:
    assert finish_reason(_out({"type": "abort", "message": "Aborted by request."})) == (
        "abort",
        None,
    )
    assert finish_reason(_out({"type": "stop", "matched": 2})) == ("stop", 2)
    assert finish_reason(_out(None)) == (None, None)


@pytest.mark.parametrize("status", [400, 500, 503])
def test_finish_reason_of_a_refusal_or_failure_raises(status: int) -> None:
    reason = {"type": "abort", "message": "no", "status_code": status}
    with pytest.raises(RequestError) as err:
        finish_reason(_out(reason))
    assert err.value.status_code == status and err.value.message == "no"


class PlainAbortTokenizerManager(FakeTokenizerManager):
    """`TRIGGER_ABORT` ends a request with an abort that has no status code, as an operator's
    abort or a full KV pool does."""

    def _advance(self, state: dict[str, Any], abort: bool) -> dict[str, Any]:
        out = super()._advance(state, abort)
        reason = out["meta_info"]["finish_reason"]
        if reason is not None and reason["type"] == "abort":
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted by request."}
        return out


@pytest.fixture(scope="module")
def plain_abort_url(default_model_path: str) -> Iterator[str]:
    from srt.model_loader.sources import get_tokenizer

    tm = PlainAbortTokenizerManager(get_tokenizer(default_model_path), default_model_path)
    with serve_openai_routes(tm) as url:
        yield url


def _body(path: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 10, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": TRIGGER_ABORT}]
    else:
        body["prompt"] = TRIGGER_ABORT
    return body


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_plain_abort_non_streaming_is_200(plain_abort_url: str, path: str) -> None:
    resp = post(plain_abort_url + path, _body(path, stream=False))
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    assert choice["finish_reason"] == "abort"
    text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
    assert text, "the tokens produced before the abort are returned"
    assert resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_plain_abort_stream_ends_with_an_abort_chunk(plain_abort_url: str, path: str) -> None:
    events = sse_events(plain_abort_url + path, _body(path, stream=True))
    *chunks, last, done = events
    assert done == "[DONE]"
    assert not any("error" in c for c in [*chunks, last]), events
    assert last["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks)
