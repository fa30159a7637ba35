"""What the server does with every request field it accepts, in one table per route.

Each field of `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and
`/v1/responses` is exactly one of:

- honoured: it changes the request as the OpenAI (or SGLang) documentation says;
- no-op: accepted, its type checked, then dropped on purpose because it cannot change the
  output here (an OpenAI account, billing or storage feature: `user`, `metadata`, `store`);
- refused: a 400 naming the field and saying why. A field we would otherwise drop but
  that asks for different output (`suffix`, `audio`, `reasoning_effort`) must not be
  answered as if it had not been sent: the client would get a plausible, wrong reply.

A field in none of these is unrecognized: a 400 too, so a typo (`max_token`) or a new
OpenAI field is visible at once instead of silently doing nothing. An explicit `null`
asks for nothing, so a refused field set to null is accepted (some clients send every
field they know, with null for the unset ones).

The request models (`protocol.py`) apply these tables in a `mode="before"` validator
(`screen`); `tests/entrypoints/test_openai_fields.py` checks that every field the installed
`openai` client can send is classified here, and the README lists the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

from pydantic import ConfigDict, TypeAdapter, ValidationError

from managers.errors import RequestError


class Treatment(str, Enum):
    HONOURED = "honoured"
    NO_OP = "no-op"
    REFUSED = "refused"


# (value, whole body) -> whether a refused field's value asks for nothing we do not do.
Allows = Callable[[Any, Mapping[str, Any]], bool]


def _only_null(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None


@dataclass(frozen=True, slots=True)
class FieldRule:
    treatment: Treatment
    why: str  # honoured: what it does; no-op: why it cannot matter; refused: why not
    origin: str = "openai"  # "openai" or "sglang" (an extra of SGLang's OpenAI routes)
    # No-op fields: the value's type, checked strictly before the value is dropped.
    kind: Any = None
    # Refused fields: the values that are accepted anyway (by default only null).
    allows: Allows = _only_null
    adapter: TypeAdapter[Any] | None = field(default=None, compare=False, repr=False)


def accepts(*values: Any) -> Allows:
    """A refused field's values that ask for nothing: null, or one of `values` (of the same
    type: a JSON 0 is not false)."""
    return lambda value, body: (
        value is None or any(type(value) is type(v) and value == v for v in values)
    )


def honoured(why: str, origin: str = "openai") -> FieldRule:
    return FieldRule(Treatment.HONOURED, why, origin)


def no_op(kind: Any, why: str, origin: str = "openai") -> FieldRule:
    adapter = TypeAdapter(kind, config=ConfigDict(strict=True))
    return FieldRule(Treatment.NO_OP, why, origin, kind=kind, adapter=adapter)


def refused(why: str, allows: Allows = _only_null, origin: str = "openai") -> FieldRule:
    return FieldRule(Treatment.REFUSED, why, origin, allows=allows)


FieldTable = Mapping[str, FieldRule]

_NO_EFFECT = "an OpenAI platform feature; no effect on the output here"

# OpenAI platform fields of chat and Responses requests that cannot change the output here.
_PLATFORM_NO_OPS: dict[str, FieldRule] = {
    "service_tier": no_op(str, "OpenAI's processing tier; " + _NO_EFFECT),
    "prompt_cache_key": no_op(
        str, "a routing hint for OpenAI's prompt cache; the radix cache here needs none"
    ),
    "prompt_cache_retention": no_op(
        str, "OpenAI's prompt-cache lifetime; the radix cache here evicts by its own policy"
    ),
    "prompt_cache_options": no_op(
        dict[str, Any], "OpenAI's prompt-cache options; the radix cache here needs none"
    ),
    "safety_identifier": no_op(str, "end-user id for OpenAI's abuse monitoring; " + _NO_EFFECT),
}

# Fields both routes share: OpenAI's sampling fields, then SGLang's extras.
_SHARED: dict[str, FieldRule] = {
    # SGLang's rule: sglang-router's PD mode forwards "unknown" for a client that sent none,
    # and many clients default to a hosted model's name.
    "model": honoured("any name: the loaded model serves it; the response echoes the name"),
    "max_tokens": honoured("max_new_tokens"),
    "temperature": honoured("temperature"),
    "top_p": honoured("top_p"),
    "seed": honoured("seed of the request's sampling"),
    "presence_penalty": honoured("presence_penalty"),
    "frequency_penalty": honoured("frequency_penalty"),
    "n": honoured("number of samples (choices) per prompt"),
    "stop": honoured("stop strings"),
    "stream": honoured("server-sent events"),
    "stream_options": honoured(
        "include_usage: a final usage chunk; with continuous_usage_stats, usage on every chunk"
    ),
    "logit_bias": honoured("token id -> bias added to its logit"),
    "user": no_op(str, "end-user id for OpenAI's abuse monitoring; " + _NO_EFFECT),
    # SGLang extras.
    "timeout": honoured("seconds the request may take in all", "sglang"),
    "priority": honoured("scheduling priority (--enable-priority-scheduling)", "sglang"),
    "bootstrap_host": honoured("prefill/decode disaggregation", "sglang"),
    "bootstrap_port": honoured("prefill/decode disaggregation", "sglang"),
    "bootstrap_room": honoured("prefill/decode disaggregation", "sglang"),
    "top_k": honoured("top_k", "sglang"),
    "min_p": honoured("min_p", "sglang"),
    "repetition_penalty": honoured("repetition_penalty", "sglang"),
    "min_tokens": honoured("min_new_tokens", "sglang"),
    "stop_token_ids": honoured("stop token ids", "sglang"),
    "stop_regex": honoured("regular expressions that stop the output (as /generate)", "sglang"),
    "ignore_eos": honoured("ignore_eos", "sglang"),
    "skip_special_tokens": honoured("skip_special_tokens", "sglang"),
    "spaces_between_special_tokens": honoured("spaces_between_special_tokens", "sglang"),
    "no_stop_trim": honoured("no_stop_trim", "sglang"),
    "response_format": honoured("text, json_object or json_schema: a JSON grammar"),
    "regex": honoured("output constrained to a regular expression", "sglang"),
    "ebnf": honoured("output constrained to an EBNF grammar", "sglang"),
    "json_schema": honoured("output constrained to a JSON schema (a string)", "sglang"),
    "lora_path": refused("not supported: this server serves no LoRA adapters", origin="sglang"),
    # sglang-router's PD mode re-serializes bodies with `false` here: accepted.
    "return_hidden_states": refused(
        "not supported: hidden states are not returned", accepts(False), "sglang"
    ),
}


def _best_of_is_n(value: Any, body: Mapping[str, Any]) -> bool:
    """SGLang's benchmark client sends `best_of: 1` with n = 1: it asks for nothing more."""
    return value is None or value == body.get("n", 1)


COMPLETION_FIELDS: FieldTable = {
    **_SHARED,
    "prompt": honoured("text, token ids, or a batch of either"),
    "echo": honoured("the prompt is prepended to each choice"),
    "logprobs": honoured("top logprobs per token (0-20)"),
    # Not an OpenAI field of this route: SGLang's extra, as on chat.
    "response_format": honoured("text, json_object or json_schema: a JSON grammar", "sglang"),
    "suffix": refused(
        "not supported: no insertion (a completion that leads up to a suffix); send the prompt only",
        accepts(""),
    ),
    "best_of": refused(
        "must equal n or be left out: every generated sample is returned, none is "
        "picked as the best of several",
        _best_of_is_n,
    ),
}

CHAT_FIELDS: FieldTable = {
    **_SHARED,
    "messages": honoured("rendered with the chat template"),
    "max_completion_tokens": honoured("max_new_tokens (wins over max_tokens)"),
    "logprobs": honoured("logprobs of the output tokens"),
    "top_logprobs": honoured("top logprobs per token (0-20, needs logprobs)"),
    "tools": honoured("function tools, rendered by the chat template"),
    "tool_choice": honoured("none, auto, required or a named function"),
    "parallel_tool_calls": honoured("whether several tool calls may be returned"),
    "metadata": no_op(dict[str, str], "tags for stored completions; " + _NO_EFFECT),
    "store": no_op(bool, "OpenAI's stored completions; " + _NO_EFFECT),
    **_PLATFORM_NO_OPS,
    "audio": refused("not supported: this server generates text only"),
    "modalities": refused('only ["text"] is supported: no audio output', accepts(["text"])),
    "prediction": refused("not supported: no predicted outputs"),
    "functions": refused("deprecated by OpenAI and not supported; use tools"),
    "function_call": refused("deprecated by OpenAI and not supported; use tool_choice"),
    "reasoning_effort": refused(
        "not supported: the effort of a reasoning model cannot be set here (a chat template "
        "may take a switch in chat_template_kwargs, e.g. enable_thinking)"
    ),
    "verbosity": refused("not supported: the detail of an answer cannot be set this way"),
    "web_search_options": refused("not supported: this server has no web search"),
    "moderation": refused("not supported: this server runs no moderation"),
    "chat_template_kwargs": honoured("keyword arguments for the chat template", "sglang"),
    "separate_reasoning": honoured("split the thinking off (with a reasoning parser)", "sglang"),
    # As sglang-router's PD mode sends them by default (false, true): accepted.
    "continue_final_message": refused(
        "not supported: a final assistant message is not continued",
        accepts(False),
        "sglang",
    ),
    "stream_reasoning": refused(
        "only true is supported: reasoning is streamed as it is generated",
        accepts(True),
        "sglang",
    ),
}

EMBEDDING_FIELDS: FieldTable = {
    "model": honoured("any name: the loaded model serves it; the response echoes the name"),
    "input": honoured("text, token ids, or a batch of either; each is one embedding"),
    "encoding_format": honoured("float (a list) or base64 (little-endian float32 bytes)"),
    "dimensions": honoured(
        "Matryoshka truncation, then normalized; only for a model trained for it (its "
        "config.json's matryoshka_dimensions or is_matryoshka)"
    ),
    "user": no_op(str, "end-user id for OpenAI's abuse monitoring; " + _NO_EFFECT),
}


def _all_null(value: Any, body: Mapping[str, Any]) -> bool:
    """An options object that sets nothing (`reasoning: {"effort": null}`)."""
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


RESPONSES_FIELDS: FieldTable = {
    "model": honoured("any name: the loaded model serves it; the response echoes the name"),
    "input": honoured(
        "a string, or items: messages (text parts), function_call, function_call_output, reasoning"
    ),
    "instructions": honoured("a system message before the input; not carried to a next turn"),
    "max_output_tokens": honoured("max_new_tokens; reaching it makes the response incomplete"),
    "temperature": honoured("temperature"),
    "top_p": honoured("top_p"),
    "stream": honoured("server-sent events in the Responses event sequence"),
    "tools": honoured("function tools, rendered by the chat template; other types refused"),
    "tool_choice": honoured("none, auto, required or a named function"),
    "parallel_tool_calls": honoured("whether several function calls may be returned"),
    "previous_response_id": honoured(
        "continue a stored response: its input and output come before this input"
    ),
    "store": honoured(
        "true (default): kept in the server's bounded in-memory store (--response-store-size) "
        "for previous_response_id and GET /v1/responses/{id}; false: nothing kept"
    ),
    "text": honoured("format text, json_object or json_schema (a JSON grammar)"),
    "metadata": honoured("echoed in the response"),
    "user": no_op(str, "end-user id for OpenAI's abuse monitoring; " + _NO_EFFECT),
    **_PLATFORM_NO_OPS,
    "stream_options": no_op(dict[str, Any], "include_obfuscation: padding, never added here"),
    # The OpenAI Agents SDK sends `include: []` on every request.
    "include": refused("not supported: no extra output data is included", accepts([])),
    "reasoning": refused(
        "not supported: a reasoning model's effort and summaries cannot be set here",
        _all_null,
    ),
    "truncation": refused(
        'only "disabled" is supported: an input too long for the context is refused, never cut',
        accepts("disabled"),
    ),
    "top_logprobs": refused("not supported on this route: use /v1/chat/completions", accepts(0)),
    "max_tool_calls": refused("not supported: calls are limited by tool_choice only"),
    "background": refused("not supported: no background responses", accepts(False)),
    "background_options": refused("not supported: no background responses"),
    "conversation": refused("not supported: no conversations; use previous_response_id"),
    "prompt": refused("not supported: no stored prompt templates"),
    "context_management": refused("not supported: no context compaction"),
    "moderation": refused("not supported: this server runs no moderation"),
    "image": refused("not supported: this server generates text only"),
    "access_programs": refused("not supported: no hosted tools or programs"),
}

# A message of `messages`.
MESSAGE_FIELDS: FieldTable = {
    "role": honoured("system, developer, user, assistant or tool"),
    "content": honoured("a string or a list of text parts"),
    "name": honoured("passed to the chat template"),
    "tool_calls": honoured("an assistant message's tool calls, passed to the template"),
    "tool_call_id": honoured("the call a tool message answers"),
    "reasoning_content": honoured("an assistant message's thinking", "sglang"),
    "refusal": no_op(str | None, "the refusal text of an earlier OpenAI answer; not rendered"),
    "audio": refused("not supported: this server serves a text-only model"),
    "function_call": refused("deprecated by OpenAI and not supported; use tool_calls"),
}

# A part of a message's `content` list, by its `type`.
CONTENT_PART_TYPES: FieldTable = {
    "text": honoured("text, joined with newlines"),
    "image_url": refused("not supported: this server serves a text-only model"),
    "input_audio": refused("not supported: this server serves a text-only model"),
    "file": refused("not supported: this server serves a text-only model"),
    "refusal": refused("not supported; send the refusal's text as a text part"),
}

# The fields of a text part.
TEXT_PART_FIELDS: FieldTable = {
    "type": honoured("text"),
    "text": honoured("the text"),
    "prompt_cache_breakpoint": no_op(
        dict[str, Any], "a breakpoint of OpenAI's prompt cache; the radix cache needs none"
    ),
}

STREAM_OPTIONS_FIELDS: FieldTable = {
    "include_usage": honoured("a final chunk with the usage"),
    # vLLM's extra, as load generators (guidellm, aiperf --per-chunk-usage) send it;
    # SGLang's routes take it too.
    "continuous_usage_stats": honoured(
        "with include_usage: every chunk carries its choice's usage so far (prompt, "
        "completion, total tokens); without include_usage nothing, as on vLLM",
        "sglang",
    ),
    "include_obfuscation": no_op(bool, "padding against side channels; never added here"),
}


def screen(table: FieldTable, known: Mapping[str, Any], data: Any, nested: bool) -> Any:
    """`data` (a request object) without its no-op fields, once their types are checked,
    and without refused fields whose value asks for nothing (null, `best_of` equal to n).

    Raises for a refused or unrecognized field. At the top level the error is a
    `RequestError` whose param is the field (pydantic wraps it, a ValueError, and
    `request_error_from_validation` unwraps it); in a nested object (`nested`) it is a
    plain ValueError, which pydantic reports at that object's location (`messages.0`).
    `known`: the model's declared fields, taken as honoured (the table test checks that
    each is in the table)."""
    if not isinstance(data, dict):
        return data  # the model reports the wrong type
    kept: dict[str, Any] = {}
    for name, value in data.items():
        rule = table.get(name)
        if rule is None or rule.treatment is Treatment.HONOURED:
            if rule is None and name not in known:
                _fail(f"Unrecognized request field `{name}`", name, nested)
            kept[name] = value
        elif rule.treatment is Treatment.NO_OP:
            assert rule.adapter is not None
            try:
                rule.adapter.validate_python(value)
            except ValidationError as err:
                why = err.errors()[0].get("msg", "invalid value")
                _fail(f"`{name}`: {why} (the field is accepted and has no effect)", name, nested)
        elif not rule.allows(value, data):  # refused, unless its value asks for nothing
            _fail(f"`{name}`: {rule.why}", name, nested)
    return kept


def _fail(message: str, name: str, nested: bool) -> NoReturn:
    if nested:
        raise ValueError(message)
    raise RequestError(message, param=name)


def treatment_table(table: FieldTable) -> list[tuple[str, str, str]]:
    """(field, treatment, why) rows, sorted by treatment then name: the README's table."""
    order = list(Treatment)
    rows = sorted(table.items(), key=lambda kv: (order.index(kv[1].treatment), kv[0]))
    return [(name, rule.treatment.value, rule.why) for name, rule in rows]
