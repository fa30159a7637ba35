"""SGLang's native HTTP API against a real server process."""

from __future__ import annotations

import itertools

import orjson
import pytest
import requests

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120, **kw)


def sse_items(resp: requests.Response) -> list:
    """Parse `data:` lines; the stream must end with [DONE]."""
    items, done = [], False
    for line in resp.iter_lines():
        if not line or line.startswith(b":"):  # blank, or an SSE comment (keep-alive)
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        if payload == b"[DONE]":
            done = True
            break
        items.append(orjson.loads(payload))
    assert done, "stream did not end with data: [DONE]"
    return items


def test_generate_text(url: str) -> None:
    r = post(url, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"].startswith(" Paris")
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0 and meta["id"]


def test_generate_stream_is_cumulative_and_matches(url: str) -> None:
    body = {"text": "Count: one, two,", "sampling_params": GREEDY}
    full = post(url, "/generate", body).json()
    r = post(url, "/generate", {**body, "stream": True}, stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    items = sse_items(r)
    assert len(items) >= 2
    for a, b in itertools.pairwise(items):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert [i["meta_info"]["finish_reason"] is None for i in items[:-1]] == [True] * (
        len(items) - 1
    )
    assert items[-1]["text"] == full["text"] and items[-1]["output_ids"] == full["output_ids"]


def test_batch_and_input_ids(url: str) -> None:
    prompts = ["Hello, my name is", "1, 2, 3,"]
    singles = [
        post(url, "/generate", {"text": p, "sampling_params": GREEDY}).json() for p in prompts
    ]
    batch = post(url, "/generate", {"text": prompts, "sampling_params": GREEDY}).json()
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    ids = requests.post(url + "/tokenize", json={"prompt": prompts[1]}, timeout=10).json()
    by_ids = post(url, "/generate", {"input_ids": ids["tokens"], "sampling_params": GREEDY})
    assert by_ids.json()["output_ids"] == singles[1]["output_ids"]
    both = post(url, "/generate", {"input_ids": [ids["tokens"]] * 2, "sampling_params": GREEDY})
    assert [b["output_ids"] for b in both.json()] == [singles[1]["output_ids"]] * 2


def test_batch_stream_carries_indices(url: str) -> None:
    body = {"text": ["a b c", "x y z"], "sampling_params": GREEDY, "stream": True}
    items = sse_items(post(url, "/generate", body, stream=True))
    finals = {i["index"]: i for i in items if i["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]


def test_n_samples_and_rid(url: str) -> None:
    params = {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "seed": 7}
    r = post(url, "/generate", {"text": "Once upon a time", "sampling_params": params})
    outs = r.json()
    assert [o["index"] for o in outs] == [0, 1, 2]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # seeds differ per sample
    again = post(url, "/generate", {"text": "Once upon a time", "sampling_params": params})
    assert [o["output_ids"] for o in again.json()] == [o["output_ids"] for o in outs]
    named = post(url, "/generate", {"text": "Hi", "sampling_params": GREEDY, "rid": "my-rid-1"})
    assert named.json()["meta_info"]["id"] == "my-rid-1"


def test_logprobs(url: str) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    meta = post(url, "/generate", body).json()["meta_info"]
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == 5 and inp[0][0] is None and all(lp <= 0 for lp, _, _ in inp[1:])
    assert len(out) == 4 and out[0][2] == " Paris"
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(t) == 3 for t in tops)
    for (lp, tok, _), top in zip(out, tops, strict=True):  # greedy picks the top-1
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5
    assert len(meta["input_top_logprobs"]) == 5


def test_stop_string_trimmed(url: str) -> None:
    free = post(
        url,
        "/generate",
        {
            "text": "Count: 1, 2, 3, 4, 5,",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0},
        },
    ).json()
    assert " 8" in free["text"]
    stopped = post(
        url,
        "/generate",
        {
            "text": "Count: 1, 2, 3, 4, 5,",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": " 8"},
        },
    ).json()
    assert stopped["text"] == free["text"][: free["text"].index(" 8")]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 8"}


def test_info_routes(url: str) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(url + path, timeout=10).json()
        assert info["is_generation"] is True and info["served_model_name"]
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(url + path, timeout=10).json()
        assert info["dtype"] == "float32" and info["max_total_num_tokens"] == 32768
        assert "memory_integrity" in info and "api_key" not in info
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200


def test_tokenize_detokenize(url: str) -> None:
    tok = requests.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    text = requests.post(url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert text["text"] == "Hello world"
    many = requests.post(url + "/tokenize", json={"prompt": ["a", "b c"]}, timeout=10).json()
    assert len(many["tokens"]) == 2 and many["count"] == [len(t) for t in many["tokens"]]


def test_flush_cache_then_no_cached_tokens(url: str) -> None:
    body = {"text": "A long shared prefix " * 8, "sampling_params": {"max_new_tokens": 1}}
    post(url, "/generate", body)
    assert post(url, "/generate", body).json()["meta_info"]["cached_tokens"] > 0
    r = requests.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert post(url, "/generate", body).json()["meta_info"]["cached_tokens"] == 0


def test_unknown_fields_are_refused(url: str) -> None:
    """A misspelt or unsupported option is a 400 naming it, not silently dropped."""
    for body, param in (
        ({"text": "Hi", "sampling_params": {**GREEDY, "whatever": 1}}, "whatever"),
        ({"text": "Hi", "sampling_params": GREEDY, "extra_field": [1, 2]}, "extra_field"),
    ):
        r = post(url, "/generate", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
