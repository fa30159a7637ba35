"""Every route's request body in the OpenAPI document (`/openapi.json`).

The routes read their bodies themselves, so that a bad one answers 400 in our error shape;
FastAPI therefore knows none of them. This module describes each: the OpenAI routes from
their pydantic models, the native routes from their field tables (`native_fields.py`), so
that the document says what a client may send and a schema-driven fuzzer reaches every
body (`tests/server/test_fuzz_routes.py`). Refused fields are listed too (any value, the
reason in their description): a client learns of them, and the fuzzer sends them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, TypeAdapter

from srt.entrypoints.native_fields import ENCODE_FIELDS, GENERATE_FIELDS, SAMPLING_FIELDS
from srt.entrypoints.openai.fields import FieldTable, Treatment
from srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
)
from srt.sampling.sampling_params import SamplingParams

_REF = "#/components/schemas/{model}"

_INT, _NUM, _STR, _BOOL = ({"type": t} for t in ("integer", "number", "string", "boolean"))
_IDS = {"type": "array", "items": _INT}


def _one_or_list(schema: dict[str, Any]) -> dict[str, Any]:
    """One value, or one per prompt of a batch."""
    return {"anyOf": [schema, {"type": "array", "items": schema}]}


def _sampling_params() -> dict[str, Any]:
    typed = TypeAdapter(SamplingParams).json_schema()["properties"]
    return {"type": "object", "properties": _fields(SAMPLING_FIELDS, typed)}


# The honoured native fields' types (the tables hold what each field does, not its type).
_NATIVE_TYPES: dict[str, dict[str, Any]] = {
    "text": _one_or_list(_STR),
    "input_ids": {"anyOf": [_IDS, {"type": "array", "items": _IDS}]},
    "rid": _one_or_list(_STR),
    "stream": _BOOL,
    "return_logprob": _one_or_list(_BOOL),
    "logprob_start_len": _one_or_list(_INT),
    "top_logprobs_num": _one_or_list(_INT),
    "return_text_in_logprobs": _BOOL,
    "bootstrap_host": _one_or_list(_STR),
    "bootstrap_port": _one_or_list(_INT),
    "bootstrap_room": _one_or_list(_INT),
    "timeout": _NUM,
    "priority": _INT,
    "extra_key": _STR,
    "cache_salt": _STR,
    "dimensions": _INT,
}


_PREFIX = {Treatment.HONOURED: "", Treatment.NO_OP: "no-op: ", Treatment.REFUSED: "refused: "}


def _fields(table: FieldTable, typed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, rule in table.items():
        if rule.treatment is Treatment.HONOURED:
            schema = dict(typed.get(name, {}))
        elif rule.treatment is Treatment.NO_OP:
            schema = TypeAdapter(rule.kind).json_schema()
        else:
            schema = {}
        schema["description"] = _PREFIX[rule.treatment] + rule.why
        out[name] = schema
    return out


def _native_bodies() -> dict[str, dict[str, Any]]:
    sampling = _sampling_params()
    generate_types = {**_NATIVE_TYPES, "sampling_params": _one_or_list(sampling)}
    encode_types = {**_NATIVE_TYPES, "sampling_params": {"type": "object"}}
    tokenize = {
        "type": "object",
        "properties": {
            "prompt": _one_or_list(_STR),
            "text": _one_or_list(_STR),
            "messages": {"type": "array", "items": {"type": "object"}},
            "model": _STR,
            "add_special_tokens": _BOOL,
            "return_token_strs": _BOOL,
            "tools": {"type": "array", "items": {"type": "object"}},
        },
    }
    return {
        "/generate": {"type": "object", "properties": _fields(GENERATE_FIELDS, generate_types)},
        "/encode": {"type": "object", "properties": _fields(ENCODE_FIELDS, encode_types)},
        "/tokenize": tokenize,
        "/v1/tokenize": tokenize,
        "/detokenize": {
            "type": "object",
            "properties": {"tokens": {"anyOf": [_IDS, {"type": "array", "items": _IDS}]}},
            "required": ["tokens"],
        },
        "/abort_request": {"type": "object", "properties": {"rid": _STR, "abort_all": _BOOL}},
    }


_OPENAI_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}


def request_bodies() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(each POST route's body schema, the shared schemas its references point to)."""
    bodies = _native_bodies()
    bodies["/v1/detokenize"] = bodies["/detokenize"]
    shared: dict[str, dict[str, Any]] = {}
    for path, model in _OPENAI_MODELS.items():
        schema = model.model_json_schema(ref_template=_REF)
        shared.update(schema.pop("$defs", {}))
        bodies[path] = schema
    return bodies, shared


def describe_request_bodies(app: FastAPI) -> None:
    """Add the bodies to the document FastAPI builds (once, on first request of it)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        bodies, shared = request_bodies()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(shared)
        for path, schema in bodies.items():
            operation = doc["paths"].get(path, {}).get("post")
            if operation is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
