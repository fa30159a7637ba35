"""The tokenizer routes: `/tokenize`, `/detokenize` (also under `/v1/`) and `GET /tokenizer_info`.

Two peers define them and their clients read different keys, so each route takes both peers'
request shapes and answers with the keys both read:

- `/tokenize`: SGLang's `{"prompt": str | [str]}` and vLLM's `{"prompt": str}` answer
  `tokens`, `count`, `max_model_len` (and `token_strs` with `return_token_strs`); the chat
  shape `{"messages": [...]}` is rendered exactly as `/v1/chat/completions` renders it.
- `/detokenize`: `{"tokens": [ids]}` answers both `text` (SGLang's key) and `prompt` (vLLM's);
  SGLang's batch `{"tokens": [[ids], ...]}` answers `text` as a list.
- `/tokenizer_info`: vLLM's shape (the tokenizer's config with `tokenizer_class` and the chat
  template), which lm-evaluation-harness probes to use the server's tokenizer remotely.

Special tokens are kept by default on `/detokenize` (vLLM's behaviour, a lossless round trip,
which lm-eval relies on); SGLang's own default skips them, so send `skip_special_tokens`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from managers.errors import RequestError
from managers.tokenizer_manager import TokenizerManager
from srt.entrypoints.app_state import ShowLocalPathsDep, TokenizerManagerDep
from srt.entrypoints.http_errors import json_response, read_json_body, request_error_from_validation
from srt.entrypoints.openai.protocol import ChatCompletionRequest
from srt.entrypoints.openai.tool_use import ToolUse

router = APIRouter()

# `model` names the served model in both peers; the one loaded model answers any name.
_COMMON_FIELDS = {"model", "add_special_tokens", "return_token_strs"}
_PROMPT_FIELDS = _COMMON_FIELDS | {"prompt", "text"}
# Rendered by the chat route's own code, which validates them (and refuses what it refuses).
_CHAT_FIELDS = {"messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort"}
# The chat route always opens the assistant's turn; tokenize renders as it does.
_CHAT_DEFAULTS = {"add_generation_prompt": (True, None), "continue_final_message": (False, None)}
# Tokenizer settings that name files or how they were loaded, not how the tokenizer works.
_LOADER_KEYS = {"vocab_file", "merges_file", "tokenizer_file", "is_local", "local_files_only"}


def _tokenizer(tm: TokenizerManager) -> Any:
    if tm.tokenizer is None:
        raise RequestError("This server has no tokenizer (--skip-tokenizer-init).")
    return tm.tokenizer


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"`{name}` must be a boolean.", name)
    return value


def _check_fields(body: dict[str, Any], allowed: set[str], shape: str) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in _CHAT_DEFAULTS and value in _CHAT_DEFAULTS[name]:
            continue  # a peer's default, sent by clients that dump their whole request
        if name in _CHAT_FIELDS and value is None:
            continue
        raise RequestError(f"`{name}` is not a field of /tokenize with {shape}.", name)


def _chat_prompt(request: Request, body: dict[str, Any]) -> str:
    for name, (default, _) in _CHAT_DEFAULTS.items():
        if body.get(name, default) not in _CHAT_DEFAULTS[name]:
            raise RequestError(
                f"`{name}` must be {str(default).lower()}: /tokenize renders messages as "
                "/v1/chat/completions does.",
                name,
            )
    fields = {k: v for k, v in body.items() if k in _CHAT_FIELDS and v is not None}
    try:
        req = ChatCompletionRequest.model_validate(fields)
    except ValidationError as err:
        raise request_error_from_validation(err) from None
    chat = request.app.state.openai.chat
    return chat.apply_chat_template(req, ToolUse.from_request(req, chat.server))


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request, tm: TokenizerManagerDep) -> Response:
    body = await read_json_body(request)
    tokenizer = _tokenizer(tm)
    with_strs = _flag(body, "return_token_strs", False)
    chat = body.get("messages") is not None
    if chat:
        _check_fields(body, _COMMON_FIELDS | _CHAT_FIELDS, "`messages`")
        # The template writes its own special tokens, so none are added by default (vLLM).
        add_special = _flag(body, "add_special_tokens", False)
        texts: list[str] = [_chat_prompt(request, body)]
        one = True
    else:
        _check_fields(body, _PROMPT_FIELDS, "`prompt`")
        add_special = _flag(body, "add_special_tokens", True)
        prompt = body.get("prompt", body.get("text"))
        one = not isinstance(prompt, list)
        texts = [prompt] if one else prompt
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(
                "`prompt` must be a string or a non-empty list of strings (or give `messages`).",
                "prompt",
            )

    def encode() -> tuple[list[list[int]], list[list[str]] | None]:
        ids = [tokenizer.encode(t, add_special_tokens=add_special) for t in texts]
        return ids, [tokenizer.convert_ids_to_tokens(x) for x in ids] if with_strs else None

    ids, strs = await tm.off_loop(encode)
    out: dict[str, Any] = {
        "tokens": ids[0] if one else ids,
        "count": len(ids[0]) if one else [len(x) for x in ids],
        "max_model_len": tm.context_len,
    }
    if strs is not None:
        out["token_strs"] = strs[0] if one else strs
    return json_response(out)


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request, tm: TokenizerManagerDep) -> Response:
    body = await read_json_body(request)
    tokenizer = _tokenizer(tm)
    for name in body:
        if name not in ("model", "tokens", "skip_special_tokens"):
            raise RequestError(f"`{name}` is not a field of /detokenize.", name)
    tokens = body.get("tokens")
    skip = _flag(body, "skip_special_tokens", False)
    batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
    seqs = tokens if batch else [tokens]

    def is_id(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tm.vocab_size

    def decode() -> list[str] | None:
        ok = all(isinstance(s, list) and all(is_id(t) for t in s) for s in seqs)
        return [tokenizer.decode(s, skip_special_tokens=skip) for s in seqs] if ok else None

    texts = await tm.off_loop(decode)
    if texts is None:
        raise RequestError(
            f"`tokens` must be a list of token ids in [0, {tm.vocab_size}), or a list of such "
            "lists.",
            "tokens",
        )
    if batch:
        return json_response({"text": texts})
    return json_response({"text": texts[0], "prompt": texts[0]})


@router.get("/tokenizer_info")
async def tokenizer_info(
    request: Request, tm: TokenizerManagerDep, show_local_paths: ShowLocalPathsDep
) -> Response:
    tokenizer = _tokenizer(tm)
    info = {
        k: _plain(v)
        for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if k not in _LOADER_KEYS and (show_local_paths or k != "name_or_path")
    }
    # lm-eval reads these three (its probe needs `eos_token`): the live values, which a
    # tokenizer may set outside its saved config.
    for name in ("eos_token", "bos_token", "pad_token"):
        info[name] = _plain(getattr(tokenizer, name, None))
    # The saved default is often a placeholder (1e30); the served limit is what holds.
    info["model_max_length"] = tm.context_len
    info["tokenizer_class"] = type(tokenizer).__name__
    template = tm.chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    else:
        info.pop("chat_template", None)
    return json_response(info)


def _plain(value: Any) -> Any:
    """A tokenizer setting as JSON: an added token by its text, dict keys as strings, and
    what JSON cannot carry (objects, integers past 64 bits) left out as null."""
    if isinstance(value, str | bool | float) or value is None:
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else None
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return None
