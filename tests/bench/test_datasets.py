"""Workload construction with the default model's real tokenizer (no model weights)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.bench_serving import build_parser
from bench.datasets import (
    build_dataset,
    encode,
    ordinary_token_ids,
    random_text,
    sample_generated_shared_prefix,
    sample_random,
    sample_sharegpt,
)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> Any:
    from srt.model_loader.sources import get_tokenizer

    return get_tokenizer(default_model_path)


def test_random_text_has_exact_token_counts(tokenizer: Any) -> None:
    vocab = ordinary_token_ids(tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 7, 64, 200):
        for _ in range(5):
            assert len(encode(tokenizer, random_text(tokenizer, n, rng, vocab))) == n


def test_gsp_exact_lengths_shared_system_prompt_and_seeded_shuffle(tokenizer: Any) -> None:
    rows = sample_generated_shared_prefix(tokenizer, 4, 4, 64, 8, 8, seed=5)
    assert len(rows) == 16 and all(r.output_len == 8 for r in rows)
    assert all(r.prompt_len == len(encode(tokenizer, r.prompt)) == 72 for r in rows)
    prefixes: dict[int, set[tuple[int, ...]]] = {}
    for r in rows:
        prefixes.setdefault(r.group, set()).add(tuple(encode(tokenizer, r.prompt)[:64]))
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per group
    assert len(set().union(*prefixes.values())) == 4  # and a different one per group
    groups = [r.group for r in rows]
    assert groups != sorted(groups)  # shuffled: groups arrive interleaved
    again = sample_generated_shared_prefix(tokenizer, 4, 4, 64, 8, 8, seed=5)
    assert [r.prompt for r in again] == [r.prompt for r in rows]
    other = sample_generated_shared_prefix(tokenizer, 4, 4, 64, 8, 8, seed=6)
    assert [r.prompt for r in other] != [r.prompt for r in rows]


def test_random_lengths_in_range(tokenizer: Any) -> None:
    rows = sample_random(tokenizer, 20, 40, 10, 0.5, seed=1)
    assert all(20 <= r.prompt_len <= 40 and 5 <= r.output_len <= 10 for r in rows)
    assert all(len(encode(tokenizer, r.prompt)) == r.prompt_len for r in rows)  # type: ignore[arg-type]
    ids = sample_random(tokenizer, 5, 40, 10, 1.0, seed=1, as_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 40 for r in ids)
    assert all(r.output_len == 10 for r in ids)


def conversation(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_parsing_and_filters(tokenizer: Any, tmp_path: Path) -> None:
    question = "Please explain in a few words how a radix tree stores shared prefixes."
    answer = "It keeps each shared prefix once, on the path from the root to the leaves."
    data = [
        conversation(("human", question), ("gpt", answer)),
        conversation(("gpt", "Hello there, how can I help?"), ("human", question), ("gpt", answer)),
        conversation(("human", "Hi"), ("gpt", answer)),  # prompt too short
        conversation(("human", question), ("gpt", "Ok")),  # output too short
        conversation(("human", question)),  # no reply
        conversation(("human", "word " * 1100), ("gpt", answer)),  # prompt too long
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rows = sample_sharegpt(tokenizer, str(path), 10, None, seed=0)
    assert len(rows) == 2
    assert all(r.prompt == question for r in rows)
    assert all(r.prompt_len == len(encode(tokenizer, question)) for r in rows)
    assert all(r.output_len == len(encode(tokenizer, answer)) for r in rows)
    fixed = sample_sharegpt(tokenizer, str(path), 1, 32, seed=0)
    assert len(fixed) == 1 and fixed[0].output_len == 32
    # A fixed output length also lets the "Ok" reply through.
    assert len(sample_sharegpt(tokenizer, str(path), 10, 32, seed=0)) == 3


def test_build_dataset_from_flags(tokenizer: Any) -> None:
    argv = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2"]
    argv += ["--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "16"]
    argv += ["--gsp-question-len", "4", "--gsp-output-len", "5"]
    rows = build_dataset(build_parser().parse_args(argv), tokenizer)
    assert len(rows) == 6 and {r.group for r in rows} == {0, 1}
    assert all(r.output_len == 5 for r in rows)
    with pytest.raises(ValueError, match="dataset-path"):
        build_dataset(build_parser().parse_args(["--dataset-name", "sharegpt"]), tokenizer)
