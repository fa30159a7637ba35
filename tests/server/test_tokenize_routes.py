"""`/tokenize`, `/detokenize` and `/tokenizer_info` in both peers' shapes (SGLang's and vLLM's),
over real HTTP against the shared server, and their refusals in the error shape."""

from __future__ import annotations

from typing import Any

import pytest
import requests

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Hello there"}]


def post(url: str, route: str, body: Any) -> requests.Response:
    return requests.post(url + route, json=body, timeout=30)


def ok(url: str, route: str, body: Any) -> dict[str, Any]:
    r = post(url, route, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenizer_info_in_vllm_shape(url: str, default_model_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    r = requests.get(url + "/tokenizer_info", timeout=10)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
    assert info["pad_token"] == tok.pad_token
    assert info["model_max_length"] == 8192  # the served context, not the saved placeholder
    # The server's template (--chat-template smollm2-tools), the one the chat route renders.
    assert "{%" in info["chat_template"] and "tools" in info["chat_template"]
    # No local path is shown without an API key; added tokens appear by their text.
    assert "name_or_path" not in info and "vocab_file" not in info
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"


def test_tokenize_vllm_and_sglang_prompt_shapes(url: str, default_model_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    # lm-eval's probe and RemoteTokenizer.encode send exactly this.
    one = ok(url, "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert one["tokens"] == tok.encode("test", add_special_tokens=False)
    assert one["count"] == len(one["tokens"]) and one["max_model_len"] == 8192
    assert "token_strs" not in one
    strs = ok(url, "/tokenize", {"model": "any", "prompt": "Hi you", "return_token_strs": True})
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"])
    many = ok(url, "/v1/tokenize", {"prompt": ["a", "b c"], "return_token_strs": True})
    assert many["count"] == [len(t) for t in many["tokens"]] and len(many["token_strs"]) == 2
    # SGLang's clients may dump their request model whole: its defaults are accepted.
    dumped = {"prompt": "test", "messages": None, "tools": None, "continue_final_message": False}
    assert ok(url, "/tokenize", {**dumped, "add_generation_prompt": None})["tokens"] == (
        tok.encode("test")
    )


def test_tokenize_chat_shape_matches_the_chat_route(url: str) -> None:
    ids = ok(url, "/tokenize", {"messages": CHAT})
    body = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    chat = ok(url, "/v1/chat/completions", body)
    assert ids["count"] == chat["usage"]["prompt_tokens"] == len(ids["tokens"])
    text = ok(url, "/detokenize", {"tokens": ids["tokens"]})["text"]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = ok(url, "/tokenize", {"messages": CHAT, "tools": tools})
    assert with_tools["count"] > ids["count"]  # this server's template renders the tools


def test_detokenize_answers_both_keys(url: str) -> None:
    ids = ok(url, "/tokenize", {"prompt": "Hello world"})["tokens"]
    out = ok(url, "/detokenize", {"model": "x", "tokens": ids})
    assert out == {"text": "Hello world", "prompt": "Hello world"}
    eos = ok(url, "/tokenize", {"prompt": "<|im_end|>", "add_special_tokens": False})["tokens"]
    # Special tokens are kept unless asked (vLLM's lossless default); SGLang's flag works.
    assert ok(url, "/detokenize", {"tokens": ids + eos})["prompt"] == "Hello world<|im_end|>"
    skipped = ok(url, "/v1/detokenize", {"tokens": ids + eos, "skip_special_tokens": True})
    assert skipped["text"] == "Hello world"
    batch = ok(url, "/detokenize", {"tokens": [ids, eos]})
    assert batch == {"text": ["Hello world", "<|im_end|>"]}
    assert ok(url, "/detokenize", {"tokens": []}) == {"text": "", "prompt": ""}


BAD = [
    # (route, body, param)
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": []}, "prompt"),
    ("/tokenize", {"prompt": ["a", 1]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "padding": True}, "padding"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [[1], "a"]}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(url: str, route: str, body: Any, param: str) -> None:
    r = post(url, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["message"] and err["param"] == param, err


def test_malformed_json_is_a_400(url: str) -> None:
    for route in ("/tokenize", "/detokenize"):
        r = requests.post(
            url + route, data=b"{", headers={"Content-Type": "application/json"}, timeout=10
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
