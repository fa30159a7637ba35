"""Speculative decoding on the default model (float32, as HF runs it): greedy outputs equal
HF's, grammars and stop strings end where decoding ends them, and drafts pay on a prompt
whose answer copies it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.engine.hf_reference import DEFAULT_NEW_TOKENS, DEFAULT_TEXTS, DefaultModelReference
from tests.engine.shared_worker import driver_on

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Members may "
    "borrow up to five books at a time for three weeks, and renew them twice online."
)
COPY = [
    {
        "role": "user",
        "content": f"Repeat this text exactly, changing 'five' to 'six':\n\n{PARAGRAPH}",
    }
]


@pytest.fixture(params=["ngram", "suffix"])
def algorithm(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def spec(default_worker: Any) -> Runs:
    return Runs(default_worker)


class Runs:
    """Fresh schedulers on the shared worker, one per run, which another scheduler takes over
    afterwards (so every run starts from an empty cache); one tokenizer for all of them, and
    each plain (speculation off) run done once for the module."""

    def __init__(self, worker: Any) -> None:
        from srt.model_loader.sources import get_tokenizer

        self.worker = worker
        self.tokenizer = get_tokenizer(worker.model_config.model_path, None)
        self.plain_runs: dict[str, list[dict]] = {}

    def run(
        self, algorithm: str | None, prompts: list[Any], params: dict
    ) -> tuple[list[dict], Any]:
        """Outputs and speculation stats; the pool is empty again afterwards."""
        with driver_on(
            self.worker, self.tokenizer, max_total_tokens=16384, speculative_algorithm=algorithm
        ) as d:
            outs = d.generate(prompts, params)
            d.scheduler.check_memory()
            assert d.scheduler.kv.token_usage() == 0.0
            return outs, d.scheduler.output.spec

    def plain(self, prompts: list[Any], params: dict) -> list[dict]:
        key = json.dumps([prompts, params], sort_keys=True)
        if key not in self.plain_runs:
            self.plain_runs[key] = self.run(None, prompts, params)[0]
        return self.plain_runs[key]

    def chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_greedy_outputs_equal_hf(spec: Runs, default_hf_reference: DefaultModelReference) -> None:
    ref = default_hf_reference
    params = {"max_new_tokens": DEFAULT_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    outs, stats = spec.run("ngram", [ref.prompts[t] for t in DEFAULT_TEXTS], params)
    for text, out in zip(DEFAULT_TEXTS, outs, strict=True):
        ref.assert_greedy_equal(text, out["output_ids"])
    assert stats.accepted > 0


def test_a_copying_answer_is_drafted_and_unchanged(spec: Runs, algorithm: str) -> None:
    prompt = [spec.chat(COPY)]
    greedy = {"max_new_tokens": 64, "temperature": 0}
    outs, stats = spec.run(algorithm, prompt, greedy)
    assert outs[0]["output_ids"] == spec.plain(prompt, greedy)[0]["output_ids"]
    # The answer copies the paragraph: several tokens per verify step.
    assert stats.accept_length() > 2.0, (stats.produced, stats.steps)
    sampled = {**greedy, "temperature": 0.8, "top_p": 0.9, "seed": 3}
    outs, _ = spec.run(algorithm, prompt, sampled)
    assert outs[0]["output_ids"] == spec.plain(prompt, sampled)[0]["output_ids"]


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": r"(The library opens at [a-z]+\.){2}"},
        {
            "json_schema": json.dumps(
                {
                    "type": "object",
                    "properties": {"opens": {"type": "string"}, "books": {"type": "integer"}},
                    "required": ["opens", "books"],
                }
            )
        },
    ],
)
def test_grammars_check_the_drafts(spec: Runs, constraint: dict) -> None:
    params = {"max_new_tokens": 48, "temperature": 0, **constraint}
    messages = [{"role": "user", "content": f"{PARAGRAPH}\nWhen does it open? Answer twice."}]
    prompt = [spec.chat(messages)]
    outs, _ = spec.run("ngram", prompt, params)
    plain = spec.plain(prompt, params)
    assert outs[0]["output_ids"] == plain[0]["output_ids"]
    assert outs[0]["meta_info"]["finish_reason"] == plain[0]["meta_info"]["finish_reason"]


def test_a_stop_string_inside_a_draft_ends_the_output(spec: Runs) -> None:
    params = {"max_new_tokens": 40, "temperature": 0, "stop": [" 9"]}
    prompt = ["Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7,"]
    outs, _ = spec.run("ngram", prompt, params)
    plain = spec.plain(prompt, params)
    assert outs[0]["text"] == plain[0]["text"]
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 9"}
