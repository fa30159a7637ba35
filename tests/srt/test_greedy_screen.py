"""Greedy logits through a bfloat16 copy of a float32 LM head (`LMHead.argmax_logits`,
`greedy_screen_logits` in srt/kernels/csrc/packed_linear.c): every row's maximum, and the
columns holding it, are those of the float32 panels bit for bit, near-ties that bfloat16
cannot tell apart included; the engine's greedy tokens do not change; and batches whose
logits feed more than an argmax (logprobs, penalties, logit_bias, sampling) never take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.kernels.linear import packed_linear_kernel
from srt.layers import vocab_embedding
from srt.layers.cpu_packed import prepack_cpu_weights
from srt.layers.vocab_embedding import SCREEN_ROWS, LMHead
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.server_args import ServerArgs
from tests.engine.tiny_models import VOCAB, save_tiny_model
from tests.srt.test_sampling import req

KERNEL = packed_linear_kernel()
pytestmark = pytest.mark.skipif(
    KERNEL is None or not KERNEL.screens_greedy,
    reason="no AVX512_BF16 panels: float32 LM heads run in full",
)


def head_weight(vocab: int, hidden: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=gen) * 0.05).contiguous()


def screened(x: torch.Tensor, weight: torch.Tensor, max_candidates: int = 1024):
    assert KERNEL is not None
    return KERNEL.greedy_logits(
        x,
        KERNEL.pack(weight.bfloat16()),
        weight,
        weight.double().norm(dim=1).float(),
        max_candidates,
    )


def assert_same_maxima(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each row's maximum value and the set of columns holding it are the same."""
    top_got, top_want = got.max(dim=1).values, want.max(dim=1).values
    assert torch.equal(top_got, top_want)
    assert torch.equal(got == top_got[:, None], want == top_want[:, None])
    assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 64, 300])
def test_maxima_equal_the_float32_panels(rows: int) -> None:
    weight = head_weight(4099, 96)  # a partial last panel
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 4
    want = KERNEL(x, KERNEL.pack(weight), weight.shape[0])
    got = screened(x, weight)
    assert got is not None
    assert_same_maxima(got, want)


def test_near_ties_bfloat16_cannot_tell_apart() -> None:
    """Columns whose bfloat16 copies are equal but whose float32 logits differ by a few ulps,
    and exact duplicates: the screen recomputes them all and keeps the float32 order."""
    hidden, vocab = 64, 600
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, hidden, generator=gen)
    weight = head_weight(vocab, hidden, seed=2) * 0.1
    base = (x[0] * 0.2).bfloat16().float()  # exactly representable in bfloat16
    nudge = torch.sign(x[0]) * base.abs() * 2.0**-20  # far below bfloat16's half ulp
    weight[100] = base  # the bf16 copies of 100, 101 and 400 are equal...
    weight[101] = base + nudge  # ...101 is the largest in float32 for row 0
    weight[400] = base + nudge  # an exact duplicate of 101: a tie, first index wins
    weight[250] = base - nudge
    assert torch.equal(weight[100].bfloat16(), weight[101].bfloat16())
    want = KERNEL(x, KERNEL.pack(weight), vocab)
    assert want[0, 101] > want[0, 100] and want[0, 101] == want[0, 400]
    got = screened(x, weight)
    assert got is not None
    assert_same_maxima(got, want)
    assert int(got[0].argmax()) == 101


def test_rows_it_cannot_settle_return_none() -> None:
    weight = head_weight(500, 32)
    x = torch.randn(3, 32)
    assert screened(x, weight, max_candidates=0) is None  # every row has a candidate
    spoiled = x.clone()
    spoiled[1, 5] = float("inf")
    assert screened(spoiled, weight) is None
    assert screened(torch.zeros(2, 32), weight, max_candidates=100) is None  # all 500 tie


def packed_head(vocab: int, hidden: int, dtype=torch.float32, bias: bool = False) -> LMHead:
    head = LMHead(vocab, hidden, bias=bias)
    with torch.no_grad():
        head.weight.copy_(head_weight(vocab, hidden))
        if head.bias is not None:
            head.bias.normal_()
    head.to(dtype)
    assert prepack_cpu_weights(head) == 1
    return head


def test_lm_head_argmax_logits_match_forward() -> None:
    head = packed_head(3000, 64)
    assert head.screen is not None
    for rows in (1, SCREEN_ROWS, SCREEN_ROWS + 1, 40):
        x = torch.randn(rows, 64) * 3
        got, want = head.argmax_logits(x), head(x)
        assert_same_maxima(got, want)
        if rows > SCREEN_ROWS:  # past the screen's rows: the full head
            assert torch.equal(got, want)


def test_heads_without_a_screen() -> None:
    """bfloat16 heads and heads with a bias run in full."""
    for head in (packed_head(300, 64, torch.bfloat16), packed_head(300, 64, bias=True)):
        assert head.screen is None
        x = torch.randn(2, 64, dtype=head.weight.dtype)
        assert torch.equal(head.argmax_logits(x), head(x))


def test_argmax_only_means_nothing_but_an_argmax_reads_the_logits() -> None:
    def info(**params) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_reqs([req(temperature=0.0), req(**params)], 50)

    assert info(temperature=0.0).argmax_only
    assert not info(temperature=0.7).argmax_only
    assert not info(temperature=0.0, frequency_penalty=0.5).argmax_only
    assert not info(temperature=0.0, repetition_penalty=1.2).argmax_only
    assert not info(temperature=0.0, logit_bias={3: 1.0}).argmax_only
    assert not info(temperature=0.0, min_new_tokens=2, stop_token_ids=[7]).argmax_only


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("screen"))


def greedy_run(folder: Path, params: dict, screen_rows: int, monkeypatch) -> tuple[list, int]:
    """Outputs of 6 prompts with the screen up to `screen_rows` rows, and its call count (a
    spy around the real kernel)."""
    monkeypatch.setattr(vocab_embedding, "SCREEN_ROWS", screen_rows)
    server_args = ServerArgs(
        model_path=str(folder), dtype="float32", skip_tokenizer_init=True, max_total_tokens=4096
    )
    driver = InProcessDriver(server_args)
    calls = []
    kernel = packed_linear_kernel()
    real = kernel.greedy_logits

    def counting(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(kernel, "greedy_logits", counting)
    prompts = [[(7 * i + 3 * j) % (VOCAB - 2) + 1 for j in range(5 + 9 * i)] for i in range(6)]
    fields = {"return_logprob": True} if params.pop("return_logprob", False) else {}
    outs = driver.generate(prompts, {"max_new_tokens": 24, "ignore_eos": True, **params}, **fields)
    driver.scheduler.check_memory()
    monkeypatch.undo()
    return outs, len(calls)


def test_engine_greedy_tokens_unchanged(tiny_llama: Path, monkeypatch) -> None:
    greedy = {"temperature": 0}
    screened_outs, calls = greedy_run(tiny_llama, greedy, SCREEN_ROWS, monkeypatch)
    full_outs, no_calls = greedy_run(tiny_llama, greedy, 0, monkeypatch)
    assert calls >= 23 and no_calls == 0  # every decode step of the first run took it
    assert [o["output_ids"] for o in screened_outs] == [o["output_ids"] for o in full_outs]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "return_logprob": True},
        {"temperature": 0, "frequency_penalty": 0.3},
        {"temperature": 0.8, "seed": 5},
    ],
    ids=["logprobs", "penalty", "sampled"],
)
def test_batches_reading_more_than_the_argmax_skip_it(tiny_llama, params, monkeypatch) -> None:
    outs, calls = greedy_run(tiny_llama, dict(params), SCREEN_ROWS, monkeypatch)
    assert calls == 0
    full, _ = greedy_run(tiny_llama, dict(params), 0, monkeypatch)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in full]
