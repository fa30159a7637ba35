"""logit_bias: the parameter's checks (`SamplingParams`, the OpenAI request model) and its
application to a batch's logits (`SamplingBatchInfo`, `Sampler`), on CPU tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from srt.entrypoints.http_errors import request_error_from_validation
from srt.entrypoints.openai.protocol import SamplingRequest
from srt.entrypoints.openai.serving_utils import sampling_params
from srt.sampling.sampler import Sampler
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import MAX_LOGIT_BIAS, InvalidSamplingParam, SamplingParams
from tests.srt.test_sampling import FakeReq

NEG_INF = float("-inf")


def checked(**kwargs: Any) -> SamplingParams:
    """The tokenizer manager's order: types, then normalize, then verify."""
    params = SamplingParams(**kwargs)
    params.check_types()
    params.normalize()
    params.verify(vocab_size=100)
    return params


def req(bias: dict[int | str, float] | None = None, **kwargs: Any) -> FakeReq:
    return FakeReq(checked(temperature=0.0, logit_bias=bias, **kwargs), [0], [])


# ---- SamplingParams ---------------------------------------------------------------------


def test_normalize_makes_int_keys() -> None:
    p = checked(logit_bias={"5": 1.5, 7: -2, "0": 100, "99": -100})
    assert p.logit_bias == {5: 1.5, 7: -2, 0: 100, 99: -100}
    p.normalize()  # idempotent: the scheduler may see it normalised already
    assert p.logit_bias == {5: 1.5, 7: -2, 0: 100, 99: -100}
    assert checked(logit_bias={}).logit_bias is None
    assert checked().logit_bias is None
    assert SamplingParams.from_dict({"logit_bias": {"3": 1}}).logit_bias == {"3": 1}
    many = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert len(SamplingParams(logit_bias=many).logit_bias or {}) == MAX_LOGIT_BIAS
    SamplingParams(logit_bias=dict(many)).verify(vocab_size=MAX_LOGIT_BIAS)


@pytest.mark.parametrize(
    "bias",
    [
        {"x": 1},
        {"1.5": 1},
        {"": 1},
        {" 5": 1},
        {"1" * 5000: 1},  # beyond int()'s digit limit: refused, not a 500
        {5.0: 1},
        {"-1": 1},
        {"100": 1},  # vocab_size is 100
        {"5": 101},
        {"5": -100.5},
        {"5": float("nan")},
        {"5": True},
        {"5": "1"},
        {"7": 1, "07": 2},  # one token twice
        {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)},
        [1, 2],
    ],
)
def test_bad_logit_bias_names_the_field(bias: Any) -> None:
    with pytest.raises(InvalidSamplingParam) as err:
        checked(logit_bias=bias)
    assert err.value.param == "logit_bias"


def test_openai_model_checks_entries_and_passes_them_on() -> None:
    req_ = SamplingRequest.model_validate({"logit_bias": {"5": -100, "6": 3}})
    assert sampling_params(req_, 8)["logit_bias"] == {"5": -100, "6": 3}
    assert "logit_bias" not in sampling_params(SamplingRequest.model_validate({}), 8)
    for bad in ({"x": 1}, {"5": 101}, {"5": "1"}, {"-2": 1}, [1]):
        with pytest.raises(ValidationError) as err:
            SamplingRequest.model_validate({"logit_bias": bad})
        assert request_error_from_validation(err.value).param == "logit_bias"


# ---- SamplingBatchInfo / Sampler ----------------------------------------------------------


def test_bias_is_additive_and_minus_100_bans() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, -5.0]])
    info = SamplingBatchInfo.from_reqs([req({1: 2.5, 3: -100, 4: -99.5})], 5)
    got = info.apply_logits_processing(logits)
    assert got.tolist() == [[1.0, 4.5, 3.0, NEG_INF, -104.5]]


def test_bias_comes_before_repetition_penalty() -> None:
    # Token 0 is in the prompt; rp = 2. Bias first: (-1 + 4) / 2 = 1.5 (positive, divided).
    # The other order would give -1 * 2 + 4 = 2.0.
    logits = torch.tensor([[-1.0, 0.5, 1.0]])
    params = checked(temperature=0.0, repetition_penalty=2.0, logit_bias={"0": 4})
    info = SamplingBatchInfo.from_reqs([FakeReq(params, [0], [])], 3)
    got = info.apply_logits_processing(logits)
    torch.testing.assert_close(got, torch.tensor([[1.5, 0.5, 1.0]]))
    assert Sampler().forward(logits, info).next_token_ids.item() == 0


def test_one_biased_row_leaves_the_others_bit_identical() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    reqs = [req(), req({"7": 3.0, "11": -100}), req(), req(top_k=5)]
    info = SamplingBatchInfo.from_reqs(reqs, 50)
    got = info.apply_logits_processing(logits)
    assert torch.equal(logits, before)  # the caller's tensor is never modified
    for row in (0, 2, 3):
        assert torch.equal(got[row], logits[row])
    want = logits[1].clone()
    want[7] += 3.0
    want[11] = NEG_INF
    assert torch.equal(got[1], want)


def test_no_bias_builds_nothing() -> None:
    logits = torch.randn(2, 10)
    info = SamplingBatchInfo.from_reqs([req(), req({})], 10)
    assert info.bias_rows is None and info.bias_ids is None and info.bias_values is None
    assert info.apply_logits_processing(logits) is logits  # no copy either


def test_greedy_follows_bias_and_logprobs_include_it() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    top = int(logits[2].argmax())
    reqs = [req({"13": 100}), req(), req({str(top): -100})]
    info = SamplingBatchInfo.from_reqs(reqs, 40)
    out = Sampler().forward(logits, info, return_logprob=True, top_logprobs_nums=[0, 0, 40])
    ids = out.next_token_ids.tolist()
    assert ids[0] == 13 and ids[1] == int(logits[1].argmax())
    assert ids[2] != top and ids[2] == int(logits[2].topk(2).indices[1])
    processed = torch.log_softmax(info.apply_logits_processing(logits), dim=-1)
    assert out.next_token_logprobs is not None and out.top_logprobs_val is not None
    torch.testing.assert_close(out.next_token_logprobs, processed[[0, 1, 2], ids])
    assert out.top_logprobs_val[2][-1] == NEG_INF  # the banned token, last of all 40


def test_sampled_rows_never_draw_a_banned_token() -> None:
    logits = torch.zeros(64, 8)
    logits[:, 3] = 6.0  # token 3 would win ~98% of draws
    reqs = [
        FakeReq(checked(temperature=1.0, logit_bias={"3": -100}), [0], [], seed)
        for seed in range(64)
    ]
    drawn = Sampler().forward(logits, SamplingBatchInfo.from_reqs(reqs, 8)).next_token_ids
    assert 3 not in drawn.tolist() and len(set(drawn.tolist())) > 1
