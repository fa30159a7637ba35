"""`/v1/chat/completions` against `FakeTokenizerManager`, over real HTTP."""

from __future__ import annotations

import json

import openai

from tests.entrypoints.fake_tokenizer_manager import FakeTokenizerManager
from tests.entrypoints.helpers import post, sse_events

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


def templated(tm: FakeTokenizerManager, messages: list[dict[str, str]]) -> str:
    return str(
        tm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_chat(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    resp = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=5)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == "fake-model"
    [obj] = tm.received
    # The templated text travels as ids, tokenized without extra special tokens.
    assert obj.text is None and obj.rid == resp.id
    prompt = templated(tm, MESSAGES)
    assert obj.input_ids == tm.tokenizer.encode(prompt, add_special_tokens=False)
    [choice] = resp.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    reply_ids = tm.tokenizer.encode(tm.reply_text(prompt, 0))
    assert choice.message.content == tm.tokenizer.decode(reply_ids[:5])
    assert choice.logprobs is None
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == len(obj.input_ids)


def test_max_tokens_default_and_max_completion_tokens(
    base_url: str, tm: FakeTokenizerManager
) -> None:
    url = f"{base_url}/v1/chat/completions"
    assert post(url, {"messages": MESSAGES}).status_code == 200
    body = {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3}
    resp = post(url, body).json()
    assert [o.sampling_params["max_new_tokens"] for o in tm.received] == [None, 3]
    assert resp["usage"]["completion_tokens"] == 3


def test_content_parts_roles_and_custom_template(base_url: str, tm: FakeTokenizerManager) -> None:
    tm.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]
    resp = post(f"{base_url}/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    sent = tm.tokenizer.decode(tm.received[0].input_ids)
    assert sent == "<system>Rules.<user>a\nb<assistant><tool>42<assistant>"


def test_chat_logprobs(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    resp = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2
    )
    [obj] = tm.received
    assert obj.return_logprob and obj.top_logprobs_num == 2 and obj.logprob_start_len == -1
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for item in content:
        assert item.logprob == -0.5 and item.bytes == list(item.token.encode())
        assert [t.logprob for t in item.top_logprobs] == [-0.5, -1.0]
        assert all(t.bytes == list(t.token.encode()) for t in item.top_logprobs)
    plain = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=2, logprobs=True
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_chat_stream_n2_with_usage(base_url: str, tm: FakeTokenizerManager) -> None:
    url = f"{base_url}/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 6, "n": 2, "stop": "scripted"}
    full = post(url, body).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_events(url, stream_body)[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert tm.received[-1].sampling_params["stop"] == "scripted"
    for choice in full["choices"]:
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        first = {k: v for k, v in own[0]["delta"].items() if v is not None}
        assert first == {"role": "assistant", "content": ""}
        content = "".join(c["delta"]["content"] or "" for c in own[1:])
        assert content == choice["message"]["content"]
        assert own[-1]["finish_reason"] == choice["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in own[:-1])


def test_chat_stream_openai_client(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    stream = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=4, stream=True, logprobs=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    tokens = [
        t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert "".join(tokens) == text and len(tokens) == 4
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is None and tm.closed_early == []


def test_response_format_json_becomes_a_schema(base_url: str, tm: FakeTokenizerManager) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = [
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, schema),
    ]
    for fmt, expected in formats:
        body = {"messages": MESSAGES, "max_tokens": 1, "response_format": fmt}
        assert post(f"{base_url}/v1/chat/completions", body).status_code == 200
        assert json.loads(tm.received[-1].sampling_params["json_schema"]) == expected


def test_response_format_text_is_accepted(base_url: str, tm: FakeTokenizerManager) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "response_format": {"type": "text"}}
    assert post(f"{base_url}/v1/chat/completions", body).status_code == 200
