"""Helpers for the constrained-decoding tests: drivers with the default model, chat prompts,
and assertions on outputs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs


def make_driver(**args: Any) -> InProcessDriver:
    args.setdefault("max_total_tokens", 32768)
    return InProcessDriver(ServerArgs(**args))


def chat(driver: InProcessDriver, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return driver.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def assert_stopped_at_eos(driver: InProcessDriver, out: dict[str, Any]) -> None:
    """The grammar terminated: the request stopped on an EOS token (not on length)."""
    reason = out["meta_info"]["finish_reason"]
    eos = driver.worker.model_config.eos_token_ids
    assert reason["type"] == "stop" and reason["matched"] in eos, (reason, out["text"])


def assert_valid_json(driver: InProcessDriver, out: dict[str, Any], schema: dict) -> None:
    assert_stopped_at_eos(driver, out)
    try:
        jsonschema.validate(json.loads(out["text"]), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        raise AssertionError(f"{out['text']!r} does not match {json.dumps(schema)}: {e}") from e
