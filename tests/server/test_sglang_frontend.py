"""SGLang's frontend language (`sgl.function` over `RuntimeEndpoint`, from the installed
`sglang` package) against a real server of the default model: `gen` (with `stop`, `regex`
and `stop_regex`), `select`, `fork`, `run_batch` and `cache_prefix`, each through the native
API exactly as the package sends it (every `gen` carries `stop_regex`, `[]` by default)."""

from __future__ import annotations

import re
from typing import Any

import pytest

sgl = pytest.importorskip("sglang")

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def backend(url: str) -> Any:
    return sgl.RuntimeEndpoint(url)


@sgl.function
def answer(s: Any, question: str) -> None:
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0, stop="\n"))


def test_gen_with_stop(backend: Any) -> None:
    state = answer.run(question=QUESTION, backend=backend)
    assert "Paris" in state["answer"] and "\n" not in state["answer"]


@sgl.function
def year(s: Any) -> None:
    s += "The year the Eiffel Tower opened:"
    s += sgl.gen("year", max_tokens=8, temperature=0, regex=r" [0-9]{4}")


def test_gen_with_regex(backend: Any) -> None:
    assert re.fullmatch(r" [0-9]{4}", year.run(backend=backend)["year"])


@sgl.function
def count(s: Any) -> None:
    s += "Count: 1, 2, 3, 4, 5,"
    s += sgl.gen("rest", max_tokens=24, temperature=0, stop_regex=r"\b[78]\b")


def test_gen_with_stop_regex(backend: Any) -> None:
    rest = count.run(backend=backend)["rest"]
    assert re.search(r"\b[78]\b", rest) and len(rest) < 24


@sgl.function
def pick(s: Any) -> None:
    s += sgl.user(QUESTION)
    s += sgl.assistant(sgl.select("city", choices=["Paris", "London", "Berlin"]))


def test_select(backend: Any) -> None:
    assert pick.run(backend=backend)["city"] == "Paris"


@sgl.function
def two_ways(s: Any) -> None:
    s += "A short list of fruits:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" {i + 1}." + sgl.gen("item", max_tokens=6, temperature=0, stop="\n")
    s += "Done."


def test_fork(backend: Any) -> None:
    state = two_ways.run(backend=backend)
    assert state.text().endswith("Done.")


def test_run_batch_and_cache_prefix(backend: Any) -> None:
    backend.cache_prefix("A long shared system prompt about geography. " * 4)
    questions = [QUESTION, "Name a large animal. One word."]
    states = answer.run_batch([{"question": q} for q in questions], backend=backend)
    alone = [answer.run(question=q, backend=backend)["answer"] for q in questions]
    assert [st["answer"] for st in states] == alone  # greedy: batching changes nothing
    assert "Paris" in alone[0] and alone[1].strip()
