"""Speculative decoding on tiny random models of every architecture: outputs with drafts
verified are token for token those without, greedy and seeded sampling, in both loops; the
KV of rejected drafts is given back; the sampled distribution is the model's.

Drafts come from the real proposers and from `OracleProposer`, a test double that drafts the
known output with every third token wrong, so every verify path (all accepted, some, none)
runs on every model whatever a random model's text looks like.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.server_args import ServerArgs
from srt.speculative.proposers import DraftProposer, DraftState
from tests.engine.draft_oracles import OracleProposer
from tests.engine.shared_worker import release
from tests.engine.tiny_models import VOCAB, save_tiny_model

pytestmark = pytest.mark.slow

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "qwen3-moe", "mixtral", "phi3"]
NEW = 20
POOL = 4096


def prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a stretch of themselves, so that n-gram lookup drafts."""
    rng = random.Random(seed)
    out = []
    for n in (12, 30, 7):
        stretch = [rng.randrange(2, VOCAB - 1) for _ in range(n)]
        out.append(stretch + [rng.randrange(2, VOCAB - 1) for _ in range(5)] + stretch[: n // 2])
    return out


@contextmanager
def make_driver(
    tiny: Tiny, spec: str | None, overlap: bool = False, **args: Any
) -> Iterator[InProcessDriver]:
    """A driver on the model's shared worker (`tests/engine/shared_worker.py`)."""
    args.setdefault("max_total_tokens", POOL)
    d = InProcessDriver(
        ServerArgs(
            model_path=tiny.folder,
            dtype="float32",
            skip_tokenizer_init=True,
            disable_overlap_schedule=not overlap,
            speculative_algorithm=spec,
            **args,
        ),
        worker=tiny.worker,
    )
    try:
        yield d
    finally:
        release(d)


def with_oracle(d: InProcessDriver, ps: list[list[int]], outs: list[list[int]]) -> None:
    """Drafts from `OracleProposer`, kept whole: the controller times no step, so how many
    tokens each request drafts (and so when the pool runs out) does not depend on how busy
    the machine is."""
    assert d.scheduler.drafts is not None
    d.scheduler.drafts.proposer = OracleProposer([p + o for p, o in zip(ps, outs, strict=True)])
    d.scheduler.drafts.time_steps = False


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def check_idle(d: InProcessDriver) -> None:
    d.scheduler.check_memory()
    assert d.scheduler.kv.token_usage() == 0.0


GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
SAMPLED = {
    "max_new_tokens": NEW,
    "temperature": 0.9,
    "top_p": 0.95,
    "top_k": 50,
    "ignore_eos": True,
    "seed": 11,
}


@dataclass
class Tiny:
    folder: str
    worker: Any
    refs: dict[str, list[list[int]]]  # outputs without speculation, by GREEDY / SAMPLED


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Tiny:
    from managers.model_worker import ModelWorker

    folder = str(save_tiny_model(request.param, tmp_path_factory.mktemp(request.param)))
    worker = ModelWorker(ServerArgs(model_path=folder, dtype="float32", max_total_tokens=POOL))
    model = Tiny(folder, worker, {})
    with make_driver(model, None) as d:
        model.refs["greedy"] = ids(d.generate(prompts(), GREEDY))
        model.refs["sampled"] = ids(d.generate(prompts(), SAMPLED))
    return model


@pytest.mark.parametrize(
    ("kind", "overlap"), [("greedy", False), ("greedy", True), ("sampled", False)]
)
def test_verified_drafts_give_the_same_tokens(tiny: Tiny, kind: str, overlap: bool) -> None:
    params = GREEDY if kind == "greedy" else SAMPLED
    with make_driver(tiny, "ngram", overlap) as d:
        with_oracle(d, prompts(), tiny.refs[kind])
        assert ids(d.generate(prompts(), params)) == tiny.refs[kind]
        stats = d.scheduler.output.spec
        assert 0 < stats.accepted < stats.drafted  # whole and partial acceptance both ran
        check_idle(d)


def test_the_proposers_give_the_same_tokens(tiny: Tiny) -> None:
    with make_driver(tiny, "ngram", speculative_ngram_min_match_window_size=1) as d:
        assert ids(d.generate(prompts(), GREEDY)) == tiny.refs["greedy"]
        assert d.scheduler.output.spec.drafted > 0
        check_idle(d)


# ---- one architecture: logprobs, stops, penalties, retraction, aborts, the distribution ----
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Tiny:
    from managers.model_worker import ModelWorker

    folder = str(save_tiny_model("llama", tmp_path_factory.mktemp("llama-spec")))
    worker = ModelWorker(ServerArgs(model_path=folder, dtype="float32", max_total_tokens=POOL))
    return Tiny(folder, worker, {})


def run(tiny: Tiny, spec: bool, params: Any, ps: list[list[int]], **fields: Any) -> list[dict]:
    """Outputs of `ps`; with `spec`, drafted by the oracle from the outputs without."""
    with make_driver(tiny, None) as d:
        plain = d.generate(ps, params, **fields)
    if not spec:
        return plain
    with make_driver(tiny, "ngram") as d:
        with_oracle(d, ps, ids(plain))
        outs = d.generate(ps, params, **fields)
        assert d.scheduler.output.spec.accepted > 0
        check_idle(d)
    return outs


def test_sampled_drafts_in_the_overlap_loop_and_the_suffix_proposer(llama: Tiny) -> None:
    plain = ids(run(llama, False, SAMPLED, prompts()))
    with make_driver(llama, "ngram", overlap=True) as d:
        with_oracle(d, prompts(), plain)
        assert ids(d.generate(prompts(), SAMPLED)) == plain
        assert d.scheduler.output.spec.accepted > 0
        check_idle(d)
    greedy = ids(run(llama, False, GREEDY, prompts()))
    with make_driver(llama, "suffix", speculative_ngram_min_match_window_size=1) as d:
        assert ids(d.generate(prompts(), GREEDY)) == greedy
        assert d.scheduler.output.spec.drafted > 0
        check_idle(d)


def test_parallel_samples_each_verify_their_own_drafts(llama: Tiny) -> None:
    params = {**SAMPLED, "n": 3}
    plain = ids(run(llama, False, params, prompts()[:2]))
    assert len(plain) == 6 and plain[0] != plain[1]  # seeds seed, seed + 1, seed + 2
    with make_driver(llama, "ngram") as d:
        with_oracle(d, [p for p in prompts()[:2] for _ in range(3)], plain)
        assert ids(d.generate(prompts()[:2], params)) == plain
        assert d.scheduler.output.spec.accepted > 0
        check_idle(d)


def test_logprobs_are_those_of_decoding_one_token_at_a_time(llama: Tiny) -> None:
    fields = {"return_logprob": True, "top_logprobs_num": 3}
    for params in (GREEDY, SAMPLED):
        plain = run(llama, False, params, prompts(), **fields)
        spec = run(llama, True, params, prompts(), **fields)
        for a, b in zip(plain, spec, strict=True):
            assert a["output_ids"] == b["output_ids"]
            lp_a, lp_b = (
                a["meta_info"]["output_token_logprobs"],
                b["meta_info"]["output_token_logprobs"],
            )
            assert [t for _, t, *_ in lp_a] == [t for _, t, *_ in lp_b]
            assert [v for v, *_ in lp_a] == pytest.approx([v for v, *_ in lp_b], abs=1e-4)
            tops_a, tops_b = (
                a["meta_info"]["output_top_logprobs"],
                b["meta_info"]["output_top_logprobs"],
            )
            assert [[t for _, t, *_ in row] for row in tops_a] == [
                [t for _, t, *_ in row] for row in tops_b
            ]


def test_stops_inside_a_draft_end_the_output_where_decoding_would(llama: Tiny) -> None:
    plain = ids(run(llama, False, GREEDY, prompts()))
    stop_at = plain[0][6]  # its first occurrence ends the first request
    first = plain[0].index(stop_at)
    params = {**GREEDY, "ignore_eos": False, "stop_token_ids": [stop_at]}
    spec = run(llama, True, params, prompts())
    assert spec[0]["output_ids"] == plain[0][: first + 1]
    assert spec[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert ids(run(llama, True, {**GREEDY, "max_new_tokens": 3}, prompts())) == [
        o[:3] for o in plain
    ]


def test_penalties_and_min_tokens_count_the_drafts_before_each_row(llama: Tiny) -> None:
    params = {
        **SAMPLED,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.3,
        "min_new_tokens": 5,
        "ignore_eos": False,
    }
    assert ids(run(llama, True, params, prompts())) == ids(run(llama, False, params, prompts()))


def test_retraction_and_aborts_leave_no_slot_behind(llama: Tiny) -> None:
    """Six requests outgrow a 300-token pool, so some are retracted (their drafts' slots
    included) and recomputed; the outputs stay those of decoding."""
    from managers.model_worker import ModelWorker

    rng = random.Random(4)
    batch = [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in (30, 40, 35, 45, 32, 38)]
    params = {**GREEDY, "max_new_tokens": 48}
    small = ServerArgs(model_path=llama.folder, dtype="float32", max_total_tokens=300)
    tight = Tiny(llama.folder, ModelWorker(small), {})
    with make_driver(tight, None, max_total_tokens=300) as d:
        plain = ids(d.generate(batch, params))
    with make_driver(tight, "ngram", max_total_tokens=300) as d:
        with_oracle(d, batch, plain)
        assert ids(d.generate(batch, params)) == plain
        assert d.scheduler.decode.num_retracted_reqs > 0
        assert d.scheduler.output.spec.accepted > 0
        check_idle(d)
        # Aborts between verify steps.
        rids = [d.submit(p, dict(params))[0] for p in batch[:3]]
        for _ in range(4):
            d.step()
        d.abort(rids[1])
        for _ in range(3):
            d.step()
        d.abort(rids[2])
        d.run_until_idle()
        assert d.result(rids[0])["output_ids"] == plain[0]
        assert d.result(rids[1])["meta_info"]["finish_reason"]["type"] == "abort"
        check_idle(d)


def chi_square_limit(df: int, z: float = 3.09) -> float:
    """The chi-square statistic a true hypothesis exceeds with probability ~0.001
    (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


class FirstTokenOracle(DraftProposer):
    """A test double: after `prompt` and one output token a, drafts `table[a]`."""

    name = "first-token-oracle"

    def __init__(self, prompt: list[int], table: list[int]) -> None:
        super().__init__(1, 1)
        self.prompt, self.table = prompt, table

    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        if len(tokens) == len(self.prompt) + 1 and tokens[:-1] == self.prompt:
            return [self.table[tokens[-1]]][:k]
        return []


def chi_square(observed: list[int], expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of token counts against expected counts (bins under 5 pooled),
    and the value a true hypothesis exceeds with probability ~0.001 (Wilson-Hilferty)."""
    obs = torch.bincount(torch.tensor(observed), minlength=len(expected)).double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([obs[big], obs[~big].sum().view(1)])
    stat = float(((o - e) ** 2 / e.clamp(min=1e-9)).sum())
    df = len(e) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_tokens_follow_the_model_distribution(llama: Tiny) -> None:
    """Many seeded draws of three tokens; the second token's draft (the model's likeliest
    after the first) is verified, so the third comes from a verify row after an accepted
    draft or from the step after a rejected one. Each token's counts are checked against its
    exact conditional distribution given the draw's earlier tokens, from HF transformers:
    expected count of v = sum over draws of p(v | prompt + that draw's tokens)."""
    from transformers import AutoModelForCausalLM

    temperature, draws = 0.7, 600
    prompt = prompts()[1]
    hf = AutoModelForCausalLM.from_pretrained(llama.folder, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
        return torch.softmax(logits / temperature, -1)

    after_first = next_probs([[a] for a in range(VOCAB)])
    params = [
        {"max_new_tokens": 3, "temperature": temperature, "ignore_eos": True, "seed": s}
        for s in range(draws)
    ]
    big = {"speculative_max_batch_size": draws, "speculative_max_batch_tokens": draws}
    with make_driver(llama, "ngram", **big) as d:
        table = after_first.argmax(-1).tolist()
        d.scheduler.drafts.proposer = FirstTokenOracle(prompt, table)
        outs = ids(d.generate([prompt] * draws, params))
        assert d.scheduler.output.spec.accepted > draws // 10
        check_idle(d)
    firsts = torch.tensor([o[0] for o in outs])
    stat, limit = chi_square([o[1] for o in outs], after_first[firsts].sum(0))
    assert stat < limit, (stat, limit)
    pairs = sorted({(o[0], o[1]) for o in outs})
    row = {pair: i for i, pair in enumerate(pairs)}
    after_two = next_probs([list(p) for p in pairs])
    expected = after_two[torch.tensor([row[(o[0], o[1])] for o in outs])].sum(0)
    stat, limit = chi_square([o[2] for o in outs], expected)
    assert stat < limit, (stat, limit)
