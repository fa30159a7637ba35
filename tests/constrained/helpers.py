"""Helpers for the constrained-decoding tests: drivers with the default model, chat prompts,
and assertions on outputs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import torch

from constrained.base_grammar_backend import BaseGrammarObject
from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs


class AcceptAllMatcher(BaseGrammarObject):
    """Test double of a grammar matcher, for tests of compiling and caching: it keeps what
    it was built from, accepts every token and masks none."""

    def __init__(self, compiled: Any = None) -> None:
        self.compiled = compiled

    def accept_token(self, token: int) -> bool:
        return True

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass


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
