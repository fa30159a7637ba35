"""lm-evaluation-harness's `local-completions` model against the real server, through lm-eval's
own Python API: with no `tokenizer` argument it detects the server's tokenizer
(`/tokenizer_info`, `/tokenize`, `/detokenize`) instead of downloading one, and its
log-likelihoods equal lm-eval's `hf` backend on the same model in float32.

The requests are inline `Instance`s, and a multiple-choice task whose three questions are a
local JSON file run through `lm_eval.simple_evaluate`: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

pytestmark = pytest.mark.slow

lm_eval = pytest.importorskip("lm_eval")

PAIRS = [
    ("The capital of France is", " Paris"),
    ("1, 2, 3,", " 4, 5"),
    ("Question: What colour is the sky?\nAnswer:", " blue"),
]
ROLLING = "Hello world, this is a short test of rolling log-likelihood."
TOLERANCE = 1e-3


def instances(kind: str, args: list[tuple[str, ...]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def hf_lm(default_model_path: str) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=default_model_path, dtype="float32", device="cpu", batch_size=1)


@pytest.fixture(scope="module")
def remote_lm(url: str) -> Any:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    # No `tokenizer` and no `tokenizer_backend`: lm-eval picks the backend by probing.
    return LocalCompletionsAPI(base_url=url + "/v1/completions", model=model, max_retries=1)


def test_remote_tokenizer_is_detected(remote_lm: Any, hf_lm: Any) -> None:
    from lm_eval.utils import RemoteTokenizer

    assert remote_lm.tokenizer_backend == "remote"
    assert isinstance(remote_lm.tokenizer, RemoteTokenizer)
    hf_tok = hf_lm.tokenizer
    assert remote_lm.eot_token_id == hf_tok.eos_token_id
    assert remote_lm.eos_string == hf_tok.eos_token
    text = "Tokenize me, please: 12345 ünïcode"
    ids = remote_lm.tok_encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert remote_lm.tokenizer.decode(ids) == text


def test_loglikelihood_equals_hf(remote_lm: Any, hf_lm: Any) -> None:
    got = remote_lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)
    want = hf_lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)
    assert len(got) == len(want) == len(PAIRS)
    for (lp, greedy), (hf_lp, hf_greedy) in zip(got, want, strict=True):
        assert abs(lp - hf_lp) < TOLERANCE, (got, want)
        assert greedy == hf_greedy, (got, want)


def test_loglikelihood_rolling_equals_hf(remote_lm: Any, hf_lm: Any) -> None:
    reqs = [(ROLLING,)]
    got = remote_lm.loglikelihood_rolling(instances("loglikelihood_rolling", reqs), True)
    want = hf_lm.loglikelihood_rolling(instances("loglikelihood_rolling", reqs), True)
    assert abs(got[0] - want[0]) < TOLERANCE, (got, want)


def test_generate_until_equals_hf(remote_lm: Any, hf_lm: Any) -> None:
    params = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    reqs = [(PAIRS[0][0], params)]
    got = remote_lm.generate_until(instances("generate_until", reqs), disable_tqdm=True)
    want = hf_lm.generate_until(instances("generate_until", reqs), disable_tqdm=True)
    assert got == want and any(got), (got, want)


def test_local_chat_completions_generates_as_hf(url: str, hf_lm: Any) -> None:
    """`local-chat-completions` sends the messages; the server's template renders them as the
    model's own does, so the greedy answer equals `hf` on the same chat, templated locally."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat_lm = LocalChatCompletion(base_url=url + "/v1/chat/completions", model=model)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    got = chat_lm.generate_until(
        instances("generate_until", [(chat_lm.apply_chat_template(chat), params)]), True
    )
    want = hf_lm.generate_until(
        instances("generate_until", [(hf_lm.apply_chat_template(chat), params)]), True
    )
    assert got == want and got[0], (got, want)


MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Rome"]},
    {"question": "How many legs does a dog have?", "choices": ["two", "four", "six"]},
    {"question": "What colour is grass?", "choices": ["blue", "red", "green"]},
]


def mc_task(folder: Path) -> dict[str, Any]:
    """An lm-eval multiple-choice task (a task config, as a YAML file would give it) over
    a local JSON Lines file."""
    data = folder / "test.jsonl"
    data.write_text("".join(json.dumps(doc | {"answer": 0}) + "\n" for doc in MC_DOCS))
    return {
        "task": "radixrt_tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "higher_is_better": True}],
    }


def test_multiple_choice_task_equals_hf(
    remote_lm: Any, hf_lm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real lm-eval task through `simple_evaluate`: every choice's log-likelihood, and so
    the accuracy, as the `hf` backend scores them."""
    pytest.importorskip("sacrebleu")  # lm_eval.evaluator imports its metrics
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task = mc_task(tmp_path)
    # The task is given whole, so no index of lm-eval's own task files is needed (building
    # one reads thousands of them: seconds per call).
    runs = [
        simple_evaluate(
            model=lm,
            tasks=[dict(task)],
            log_samples=True,
            task_manager=TaskManager(include_defaults=False),
        )
        for lm in (remote_lm, hf_lm)
    ]
    (got, want) = (
        [sample["filtered_resps"] for sample in run["samples"]["radixrt_tiny_mc"]] for run in runs
    )
    assert len(got) == len(want) == len(MC_DOCS)
    for doc_got, doc_want in zip(got, want, strict=True):
        assert len(doc_got) == 3
        for (lp, _), (hf_lp, _) in zip(doc_got, doc_want, strict=True):
            assert abs(lp - hf_lp) < TOLERANCE, (got, want)
    accuracy = [run["results"]["radixrt_tiny_mc"]["acc,none"] for run in runs]
    assert accuracy[0] == accuracy[1]
