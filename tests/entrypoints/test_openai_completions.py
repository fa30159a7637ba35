"""`/v1/models` and `/v1/completions` against `FakeTokenizerManager`, over real HTTP."""

from __future__ import annotations

import openai
import requests

from tests.entrypoints.fake_tokenizer_manager import CACHED_TOKENS, FakeTokenizerManager
from tests.entrypoints.helpers import post, sse_events


def expected_text(tm: FakeTokenizerManager, prompt: str, j: int, max_tokens: int) -> str:
    ids = tm.tokenizer.encode(tm.reply_text(prompt, j))
    return str(tm.tokenizer.decode(ids[:max_tokens]))


def test_models(client: openai.OpenAI, base_url: str, tm: FakeTokenizerManager) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    body = requests.get(f"{base_url}/v1/models", timeout=5).json()
    card = body["data"][0]
    assert body["object"] == "list" and card["object"] == "model"
    assert card["owned_by"] == "radixrt" and card["root"] == tm.served_model_name
    assert card["max_model_len"] == tm.context_len and isinstance(card["created"], int)
    assert client.models.retrieve("fake-model").id == "fake-model"


def test_completion(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    prompt = "Say hello"
    resp = client.completions.create(model="fake-model", prompt=prompt, max_tokens=5)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.model == "fake-model" and isinstance(resp.created, int)
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == expected_text(tm, prompt, 0, 5) and choice.logprobs is None
    usage = resp.usage
    assert usage is not None
    assert usage.prompt_tokens == len(tm.tokenizer.encode(prompt))
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    [obj] = tm.received
    assert obj.text == prompt and obj.input_ids is None and not obj.stream
    assert obj.rid == resp.id and obj.sampling_params["max_new_tokens"] == 5


def test_batch_with_n_is_prompt_major(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    prompts = ["First prompt", "Second prompt"]
    resp = client.completions.create(model=tm.model_path, prompt=prompts, n=2, max_tokens=4)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for choice in resp.choices:
        i, j = divmod(choice.index, 2)
        assert choice.text == expected_text(tm, prompts[i], j, 4)
    assert len(tm.received) == 2 and all(o.sampling_params["n"] == 2 for o in tm.received)
    assert len({o.rid for o in tm.received}) == 2
    usage = resp.usage
    assert usage is not None
    # Each prompt counted once even though it has two samples.
    assert usage.prompt_tokens == sum(len(tm.tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == 4 * 4


def test_token_id_prompts(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    ids = [tm.tokenizer.encode("One"), tm.tokenizer.encode("Two words")]
    resp = client.completions.create(model="fake-model", prompt=ids, max_tokens=2, echo=True)
    assert [o.input_ids for o in tm.received] == ids and tm.received[0].text is None
    assert resp.choices[1].text.startswith("Two words")
    client.completions.create(model="fake-model", prompt=ids[0], max_tokens=2)
    assert tm.received[-1].input_ids == ids[0]


def test_logprobs(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    resp = client.completions.create(model="fake-model", prompt="Hi", max_tokens=4, logprobs=2)
    [obj] = tm.received
    assert obj.return_logprob and obj.top_logprobs_num == 2 and obj.return_text_in_logprobs
    assert obj.logprob_start_len == -1
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == resp.choices[0].text and len(lp.tokens) == 4
    assert lp.token_logprobs == [-0.5] * 4
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1:] == [lp.text_offset[k] + len(lp.tokens[k]) for k in range(3)]


def test_echo_with_logprobs(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    prompt = "Echo this back"
    resp = client.completions.create(
        model="fake-model", prompt=prompt, max_tokens=3, echo=True, logprobs=1
    )
    assert tm.received[0].logprob_start_len == 0
    choice = resp.choices[0]
    assert choice.text == prompt + expected_text(tm, prompt, 0, 3)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    num_prompt = len(tm.tokenizer.encode(prompt))
    assert len(lp.token_logprobs) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:num_prompt] == [-1.0] * (num_prompt - 1)


def test_stream_matches_full(base_url: str, tm: FakeTokenizerManager) -> None:
    url = f"{base_url}/v1/completions"
    body = {"prompt": "Stream me", "max_tokens": 6, "n": 2}
    full = post(url, body).json()
    events = sse_events(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    for choice in full["choices"]:
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in own) == choice["text"]
        assert [c["finish_reason"] for c in own][-1] == "length"
        assert all(c["finish_reason"] is None for c in own[:-1])
    assert all(c["usage"] is None for c in chunks)
    assert tm.received[-1].stream and tm.closed_early == []


def test_stream_echo_and_logprobs(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    prompt = "Echo stream"
    stream = client.completions.create(
        model="fake-model", prompt=prompt, max_tokens=3, echo=True, logprobs=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == prompt + expected_text(tm, prompt, 0, 3)
    token_logprobs = [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]
    assert token_logprobs[0] is None and len(token_logprobs) == len(tm.tokenizer.encode(prompt)) + 3
    offsets = [o for c in chunks for o in (c.choices[0].logprobs.text_offset or [])]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_sampling_params_passthrough(base_url: str, tm: FakeTokenizerManager) -> None:
    body = {
        "prompt": "Params",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": ["\n", "END"],
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "user": "someone",  # accepted, no effect (an unknown field is a 400: test_openai_fields)
    }
    assert post(f"{base_url}/v1/completions", body).status_code == 200
    params = tm.received[0].sampling_params
    expected = {
        "max_new_tokens": 7,
        "n": 1,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": ["\n", "END"],
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_new_tokens": 2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": True,
    }
    assert params == expected
    assert post(f"{base_url}/v1/completions", {"prompt": "Defaults"}).status_code == 200
    defaults = tm.received[1].sampling_params
    assert defaults["max_new_tokens"] == 16 and "temperature" not in defaults  # OpenAI default


def test_stop_string(client: openai.OpenAI, tm: FakeTokenizerManager) -> None:
    resp = client.completions.create(model="fake-model", prompt="Stop", stop="world", max_tokens=50)
    choice = resp.choices[0]
    assert tm.received[0].sampling_params["stop"] == "world"
    assert choice.finish_reason == "stop" and choice.text.endswith("Hello ")
    assert choice.model_extra is not None and choice.model_extra["matched_stop"] == "world"
    resp = client.completions.create(model="fake-model", prompt="Stop", max_tokens=50)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra == {"matched_stop": tm.tokenizer.eos_token_id}
