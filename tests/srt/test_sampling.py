from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from srt.sampling.sampler import (
    SampleOutput,
    Sampler,
    get_top_logprobs,
    top_k_top_p_min_p_filter,
)
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams
from srt.sampling.seeded_noise import seeded_uniform


@dataclass
class FakeReq:
    """Test double for the scheduler's Req (the ReqLike protocol)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    sampling_seed: int = 0


def req(seed: int = 0, position: int = 0, **params: Any) -> FakeReq:
    return FakeReq(SamplingParams(**params), [0, 1], [3] * position, seed)


def sample(
    logits: torch.Tensor, reqs: list[FakeReq], sampler: Sampler | None = None, **kw: Any
) -> SampleOutput:
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], "cpu", eos_token_ids=[2])
    return (sampler or Sampler()).forward(logits, info, **kw)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    reqs = [req(temperature=0.0) for _ in range(3)] + [req(top_k=1) for _ in range(3)]
    out = sample(logits, reqs)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_logprobs is None and out.top_logprobs_val is None


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    reqs = [req(temperature=0.0), req(1, temperature=1.5), req(temperature=0.0), req(2)]
    out = sample(logits, reqs).next_token_ids
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(2))
    reqs = [req(seed=s, position=s % 3, temperature=1.3) for s in range(8)]
    a = sample(logits, reqs).next_token_ids
    b = sample(logits.clone(), reqs).next_token_ids
    assert torch.equal(a, b)
    other = [req(seed=s + 100, position=s % 3, temperature=1.3) for s in range(8)]
    assert not torch.equal(a, sample(logits, other).next_token_ids)


TARGET_PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 20},
    {"temperature": 1.5, "min_p": 0.05},
    {"temperature": 0.9, "top_k": 300, "top_p": 0.95, "min_p": 0.01},
]
NEIGHBOUR_PARAMS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"top_k": 5},
    {"top_k": 1000},
    {"top_p": 0.5},
    {"top_p": 0.999},
    {"min_p": 0.3},
    {"temperature": 2.0, "top_k": 2, "top_p": 0.8},
]


@pytest.mark.parametrize("params", TARGET_PARAMS)
def test_draw_is_independent_of_batch_composition(params: dict[str, Any]) -> None:
    """The key property: (seed, position) alone decide the token, whatever the batch."""
    vocab = 1000
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(candidate_budget=64)  # exercise the partial-sort and full-sort paths
    for seed in (0, 7, 12345, 2**40 + 3, 2**64 - 1):
        row = torch.randn(vocab, generator=gen) * 2.5
        target = req(seed=seed, position=seed % 11, **params)
        alone = sample(row.unsqueeze(0), [target], sampler).next_token_ids[0].item()
        for size in (2, 5, 9):
            for where in {0, size // 2, size - 1}:
                reqs = [
                    req(seed=seed + i + 1, position=i, **NEIGHBOUR_PARAMS[(seed + i) % 8])
                    for i in range(size)
                ]
                reqs[where] = target
                logits = torch.randn(size, vocab, generator=gen) * 3.0
                logits[where] = row
                got = sample(logits, reqs, sampler).next_token_ids[where].item()
                assert got == alone, (seed, size, where)


def test_different_positions_give_different_draws() -> None:
    logits = torch.zeros(64, 1000)
    reqs = [req(seed=5, position=p) for p in range(64)]
    assert len(set(sample(logits, reqs).next_token_ids.tolist())) > 50


def reference_filter(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """Independent scalar reference: intersection of the three filters, renormalised."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = [0.0] * len(probs)
    mass_before = 0.0
    for rank, i in enumerate(order):
        keep = rank < top_k and (top_p >= 1.0 or mass_before <= top_p)
        keep = keep and probs[i] >= min_p * probs[order[0]]
        kept[i] = probs[i] if keep else 0.0
        mass_before += probs[i]
    total = sum(kept)
    return [k / total for k in kept]


FILTER_CASES = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.8, "min_p": 0.05},
]
SMALL_LOGITS = [2.0, 1.6, 1.1, 0.7, 0.3, -0.2, -0.9, -1.5]


@pytest.mark.parametrize("params", FILTER_CASES)
def test_draws_match_filtered_distribution(params: dict[str, Any]) -> None:
    n, vocab = 20_000, len(SMALL_LOGITS)
    logits = torch.tensor(SMALL_LOGITS).expand(n, vocab).contiguous()
    info = SamplingBatchInfo.from_reqs([req(seed=99, **params)] * n, vocab)
    info = dataclasses.replace(info, positions=torch.arange(n))  # n independent draws
    counts = torch.bincount(Sampler().forward(logits, info).next_token_ids, minlength=vocab)

    probs = torch.softmax(torch.tensor(SMALL_LOGITS) / params["temperature"], -1).tolist()
    expected = reference_filter(
        probs, params.get("top_k", vocab), params.get("top_p", 1.0), params.get("min_p", 0.0)
    )
    chi2 = 0.0
    for c, e in zip(counts.tolist(), expected):
        if e == 0.0:
            assert c == 0, "drew a token the filters remove"
        else:
            chi2 += (c - n * e) ** 2 / (n * e)
    assert chi2 < 30.0, (chi2, counts.tolist(), expected)  # df <= 7: p ~ 1e-4


def test_filter_function_matches_reference() -> None:
    probs = torch.softmax(torch.tensor([SMALL_LOGITS] * 3), -1)
    top_ks = torch.tensor([3, 8, 8])
    top_ps = torch.tensor([1.0, 0.6, 1.0])
    min_ps = torch.tensor([0.0, 0.0, 0.25])
    got = top_k_top_p_min_p_filter(probs, top_ks, top_ps, min_ps)
    for i in range(3):
        want = reference_filter(
            probs[i].tolist(), int(top_ks[i]), float(top_ps[i]), float(min_ps[i])
        )
        torch.testing.assert_close(got[i], torch.tensor(want))


def test_uniform_noise_is_open_interval_and_roughly_uniform() -> None:
    seeds = torch.tensor([0, -1, 2**62, 17])
    u = seeded_uniform(seeds, torch.tensor([0, 1, 2, 3]), torch.arange(50_000).unsqueeze(0))
    assert u.shape == (4, 50_000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.005


def test_penalties_match_hand_computation() -> None:
    vocab = 6
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -0.5, 3.0]] * 2)
    params = SamplingParams(
        temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0
    )
    reqs = [
        FakeReq(params, origin_input_ids=[4], output_ids=[1, 1, 2], sampling_seed=0),
        FakeReq(SamplingParams(temperature=0.0), origin_input_ids=[1], output_ids=[5]),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, vocab)
    assert info.has_penalties and info.is_all_greedy
    got = info.apply_logits_processing(logits)
    # Row 0: repetition on seen {1, 2, 4}; then output counts {1: 2, 2: 1}.
    want0 = [1.0, 2.0 / 2 - (0.5 * 2 + 0.25), -1.0 * 2 - (0.5 + 0.25), 0.5, -0.5 * 2, 3.0]
    torch.testing.assert_close(got[0], torch.tensor(want0))
    torch.testing.assert_close(got[1], logits[1])  # no penalties on the neighbour
    assert logits[0, 1] == 2.0  # the caller's tensor is untouched


def test_greedy_rows_get_penalties() -> None:
    logits = torch.tensor([[4.5, 5.0, 0.0, 0.0]])
    plain = sample(logits, [req(temperature=0.0)]).next_token_ids
    penalised = FakeReq(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], [1])
    assert plain.item() == 1
    assert sample(logits, [penalised]).next_token_ids.item() == 0


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 1.0]] * 2)
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[5])
    reqs = [FakeReq(p, [0], [6]), FakeReq(p, [0], [6, 6, 6])]
    info = SamplingBatchInfo.from_reqs(reqs, 7, eos_token_ids=[2])
    masked = info.apply_logits_processing(logits)
    assert masked[0, 2] == float("-inf") and masked[0, 5] == float("-inf")
    assert torch.isfinite(masked[1]).all()  # min_new_tokens reached: no mask
    out = Sampler().forward(logits, info).next_token_ids.tolist()
    assert out == [6, 2]


def test_logprobs() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 100, generator=gen) * 2
    reqs = [req(temperature=0.0), req(1, temperature=0.8, top_p=0.9), req(2, top_k=10)]
    out = sample(logits, reqs, return_logprob=True, top_logprobs_nums=[0, 3, 5])
    logprobs = torch.log_softmax(logits, -1)
    assert out.next_token_logprobs is not None
    want = logprobs.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.next_token_logprobs, want)
    assert out.top_logprobs_val is not None and out.top_logprobs_idx is not None
    assert [len(v) for v in out.top_logprobs_val] == [0, 3, 5]
    for i, n in enumerate([0, 3, 5]):
        vals, ids = torch.topk(logprobs[i], n)
        assert out.top_logprobs_val[i] == sorted(out.top_logprobs_val[i], reverse=True)
        torch.testing.assert_close(torch.tensor(out.top_logprobs_val[i]), vals)
        assert out.top_logprobs_idx[i] == ids.tolist()
    assert get_top_logprobs(logprobs, [0, 0, 0]) == ([[], [], []], [[], [], []])


def test_sampler_step_cost() -> None:
    """B=64, V=49152: print the per-step cost; the bound only catches pathologies."""
    batch, vocab = 64, 49152
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(5)) * 3
    sampler = Sampler()
    for name, params in [
        ("greedy", {"temperature": 0.0}),
        ("temperature", {"temperature": 0.8}),
        ("top_p", {"temperature": 0.8, "top_p": 0.9}),
    ]:
        info = SamplingBatchInfo.from_reqs([req(i, i, **params) for i in range(batch)], vocab)
        sampler.forward(logits, info)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            sampler.forward(logits, info)
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"Sampler.forward B={batch} V={vocab} {name}: {best * 1e3:.2f} ms")
        assert best < 2.0 and math.isfinite(best)


def test_noise_never_reaches_one_so_zero_probability_never_wins() -> None:
    """U = 1.0 would make E = -log U = 0, and a token with p = 0 would win argmax(p / E) as
    NaN. The extreme hashes map strictly inside (0, 1) (2^-25 below 1 would round to 1.0 in
    float32), and so does a sample of real noise."""
    from srt.sampling.seeded_noise import open_unit_float, seeded_exponential, seeded_uniform

    extremes = open_unit_float(torch.tensor([0, 1, (1 << 32) - 2, (1 << 32) - 1]))
    assert float(extremes.max()) < 1.0 and float(extremes.min()) > 0.0
    assert bool((-torch.log(extremes) > 0).all())
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    positions = torch.arange(64, dtype=torch.int64) % 97
    vocab = torch.arange(49152, dtype=torch.int64).unsqueeze(0)
    u = seeded_uniform(seeds, positions, vocab)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    assert bool((seeded_exponential(seeds, positions, vocab) > 0).all())


def test_batch_info_moves_every_tensor_to_the_logits_device() -> None:
    """The scheduler builds the info on the CPU; on a GPU the worker moves it next to the
    logits (a [B, 1] CPU temperature against CUDA logits is an error). Every tensor field
    moves, penalties, bias and min-token masks included; on the CPU it is the same object."""
    reqs = [
        req(seed=1, temperature=0.7, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.5),
        req(seed=2, min_new_tokens=3, logit_bias={"5": 10.0}),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, 16, "cpu", eos_token_ids=[2])
    assert info.to("cpu") is info
    moved = info.to("meta")
    tensors = [
        f.name for f in dataclasses.fields(info) if isinstance(getattr(info, f.name), torch.Tensor)
    ]
    assert {"temperatures", "output_counts", "seen_mask", "bias_values", "min_tokens_ids"} <= set(
        tensors
    )
    assert all(getattr(moved, name).device.type == "meta" for name in tensors)
    assert moved.is_all_greedy == info.is_all_greedy and moved.vocab_size == 16


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {}])
def test_a_row_with_every_token_masked_still_gets_a_token(params: dict[str, Any]) -> None:
    """Every logit -inf (a grammar that allows only EOS under min_new_tokens): the sampler
    returns a token, as a greedy row does, and the other rows keep their draws."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    masked = logits.clone()
    masked[0] = float("-inf")
    reqs = [req(seed=1, temperature=1.0, **params), req(seed=2, temperature=1.0, **params)]
    alone = sample(masked[:1], reqs[:1]).next_token_ids
    assert alone.shape == (1,) and 0 <= int(alone[0]) < 50
    out = sample(masked, reqs).next_token_ids
    assert out.shape == (2,) and 0 <= int(out[0]) < 50
    assert out[1] == sample(logits, reqs).next_token_ids[1]
