"""Tensor parallelism end to end on CPU: greedy tokens at tp=2 (two gloo ranks of the `tp2`
fixture, each driving its own scheduler with the same calls) equal tp=1's.

Equal means identical, or else the first difference is at a near-tie of tp=1's logits (top-2
gap below `NEAR_TIE`, the rule the HF comparisons use): a sharded matmul sums in another order.
tp=1 runs in the test process and reports its top-2 logprobs, whose gap is the logits' gap.

Covered: tiny Llama, Qwen2 and Qwen3, Qwen2 with one KV head (replicated on both ranks),
Mistral, Gemma 2 and 3, Phi-3, Qwen3-MoE and Mixtral, the default model (9 q / 3 KV heads,
split 3 / 6); chunked prefill; a pool small enough to force
retraction; the overlap and the normal loop; and no rank ever sampling unlike rank 0. Also:
the ranks' share of the RAM and their agreed pool size, and a follower that samples other ids
than rank 0 still feeding back rank 0's (through the overlap loop's future placeholders too).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from managers.inprocess import InProcessDriver
from managers.model_worker import ModelWorker
from srt.configs.model_config import ModelConfig
from srt.distributed import TPGroup
from srt.model_executor.model_runner import local_model_config
from srt.server_args import ServerArgs
from tests.distributed.tp_harness import TPRanks
from tests.engine.hf_reference import NEAR_TIE
from tests.engine.tiny_models import VOCAB, save_tiny_model

GREEDY = {"temperature": 0, "ignore_eos": True}


def rand_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(n)] for n in lengths]


def generate(
    tp: TPGroup,
    model_path: str | None,
    prompts: list[list[int]],
    new_tokens: int,
    prepare: Callable[[TPGroup, InProcessDriver], None] | None = None,
    **args: Any,
) -> dict[str, Any]:
    """Runs on a rank (or, with `TPGroup.single()`, in the test process): the prompts under
    fixed rids, to completion; greedy ids, tp=1's top-2 logprobs, and the run's counters.
    `prepare` (a top-level function) may alter the driver before the run."""
    server_args = ServerArgs(
        model_path=model_path, dtype="float32", skip_tokenizer_init=True, **args
    )
    driver = InProcessDriver(server_args, tp=tp)
    if prepare is not None:
        prepare(tp, driver)
    reference = tp.size == 1
    fields = {"return_logprob": True, "top_logprobs_num": 2} if reference else {}
    rids = []
    for i, prompt in enumerate(prompts):
        params = {"max_new_tokens": new_tokens, **GREEDY}
        rids += driver.submit(prompt, params, rid=f"prompt-{i}", **fields)
    driver.run_until_idle()
    driver.scheduler.check_memory()
    results = [driver.result(rid) for rid in rids]
    return {
        "ids": [r["output_ids"] for r in results],
        "top2": [r["meta_info"].get("output_top_logprobs") for r in results],
        "retracted": driver.scheduler.decode.num_retracted_reqs,
        "mismatches": driver.worker.tp_sample_mismatches,
        "pool_tokens": driver.worker.model_runner.max_total_tokens,
    }


def assert_tp_greedy_equal(ref: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """Every rank's ids are rank 0's, and rank 0's equal tp=1's up to a near-tie."""
    assert all(r["mismatches"] == 0 for r in ranks), [r["mismatches"] for r in ranks]
    assert ranks[1]["ids"] == ranks[0]["ids"]
    assert ranks[1]["pool_tokens"] == ranks[0]["pool_tokens"]
    for i, (ours, want, top2) in enumerate(
        zip(ranks[0]["ids"], ref["ids"], ref["top2"], strict=True)
    ):
        assert len(ours) == len(want), (i, len(ours), len(want))
        diff = next((p for p, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b), None)
        if diff is None:
            continue
        (first, _), (second, _) = top2[diff][:2]
        gap = first - second
        assert gap < NEAR_TIE, (
            f"prompt {i}: first difference at output position {diff} (tp=2 {ours[diff]}, "
            f"tp=1 {want[diff]}), tp=1 top-2 logit gap {gap:.3g} is not a near-tie"
        )


def compare(
    tp2: TPRanks, model_path: str | None, prompts: list[list[int]], new_tokens: int, **args: Any
) -> list[dict[str, Any]]:
    ref = generate(TPGroup.single(), model_path, prompts, new_tokens, **args)
    ranks = tp2.run(generate, model_path, prompts, new_tokens, **args)
    assert_tp_greedy_equal(ref, ranks)
    return ranks


# ---- cheap checks of the pieces -------------------------------------------------------


def test_local_model_config_has_the_rank_heads() -> None:
    from types import SimpleNamespace

    cfg = ModelConfig(
        model_path="x",
        hf_config=SimpleNamespace(),
        architectures=["LlamaForCausalLM"],
        dtype=torch.float32,
        context_len=64,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_size=576,
        vocab_size=100,
        eos_token_ids=[0],
    )
    assert local_model_config(cfg, TPGroup.single()) is cfg
    heads = [
        (c.num_attention_heads, c.num_key_value_heads)
        for c in (local_model_config(cfg, TPGroup(r, 2)) for r in range(2))
    ]
    assert heads == [(3, 1), (6, 2)]  # split by KV group, unevenly (SmolLM2's shape)


def _take_leader_ids(tp: TPGroup) -> tuple[list[int], int]:
    worker = ModelWorker.__new__(ModelWorker)
    worker.tp, worker.num_forwards, worker.tp_sample_mismatches = tp, 1, 0
    ids, differ = worker._take_leader_ids(torch.tensor([7, 8 + tp.rank, 9 + 2 * tp.rank]))
    worker._count_mismatches(int(differ), len(ids))  # what resolving the result does
    return ids.tolist(), worker.tp_sample_mismatches


def test_sampled_ids_come_from_rank_0(tp2: TPRanks) -> None:
    assert tp2.run(_take_leader_ids) == [([7, 8, 9], 0), ([7, 8, 9], 2)]


def _pool_from_ram(tp: TPGroup, model_path: str) -> tuple[int, int]:
    """Build a runner whose rank sees (rank + 1) MiB of free RAM; its KV heads and pool."""
    from srt.model_executor import model_runner

    measured = model_runner.available_memory_bytes
    model_runner.available_memory_bytes = lambda device: (tp.rank + 1) * 2**20
    try:
        args = ServerArgs(model_path=model_path, dtype="float32", mem_fraction_static=0.3)
        runner = model_runner.ModelRunner(ModelConfig.from_path(model_path), args, tp)
    finally:
        model_runner.available_memory_bytes = measured
    return runner.local_config.num_key_value_heads, runner.max_total_tokens


def test_ranks_split_ram_and_agree_on_the_smallest_pool(
    tp2: TPRanks, tiny_models: dict[str, str]
) -> None:
    # One KV head per rank: 2 (K and V) * 2 layers * 16 dims * 4 bytes = 256 bytes a token.
    # Rank 0 sees 1 MiB and, sharing the machine with rank 1, takes 0.3 of half of it.
    smallest = int(2**20 // 2 * 0.3) // 256
    assert tp2.run(_pool_from_ram, tiny_models["qwen2"]) == [(1, smallest), (1, smallest)]


# ---- tp=2 greedy equals tp=1 ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-tiny")
    return {
        "llama": str(save_tiny_model("llama", root / "llama")),
        "qwen2": str(save_tiny_model("qwen2", root / "qwen2")),
        "qwen3": str(save_tiny_model("qwen3", root / "qwen3")),
        "qwen2-kv1": str(save_tiny_model("qwen2", root / "qwen2-kv1", num_kv_heads=1)),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "overlap"),
    [("llama", True), ("qwen2", False), ("qwen3", True), ("qwen2-kv1", False)],
)
def test_tiny_models_chunked(
    tp2: TPRanks, tiny_models: dict[str, str], model: str, overlap: bool
) -> None:
    prompts = rand_prompts([5, 23, 41], VOCAB, seed=1)
    compare(
        tp2,
        tiny_models[model],
        prompts,
        12,
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
        max_total_tokens=2048,
    )


# Every architecture added since: windows (Mistral; Gemma's local layers, window 8 here),
# Gemma 2's soft caps, Phi-3's merged qkv / gate_up split by rank, and the experts'
# intermediate dimension split by rank (Qwen3-MoE, Mixtral).
NEW_ARCHS = ["mistral", "gemma2", "gemma3", "phi3", "qwen3-moe", "mixtral"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_new_architectures_chunked(tp2: TPRanks, arch: str, tmp_path) -> None:
    folder = str(save_tiny_model(arch, tmp_path / arch))
    prompts = rand_prompts([5, 23, 41], VOCAB, seed=1)
    compare(
        tp2,
        folder,
        prompts,
        12,
        chunked_prefill_size=16,
        disable_overlap_schedule=arch not in ("gemma2", "qwen3-moe"),
        max_total_tokens=2048,
    )


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_retraction(tp2: TPRanks, tiny_models: dict[str, str], overlap: bool) -> None:
    # As tests/engine's retraction test: the admission reserve underestimates the growth of
    # these requests, so the pool runs out while they decode.
    prompts = rand_prompts([30, 40, 35, 45, 32, 38], VOCAB, seed=4)
    ranks = compare(
        tp2,
        tiny_models["qwen2"],
        prompts,
        40,
        max_total_tokens=200,
        disable_overlap_schedule=not overlap,
    )
    assert all(r["retracted"] > 0 for r in ranks), [r["retracted"] for r in ranks]


@pytest.mark.slow
def test_default_model_uneven_heads(tp2: TPRanks) -> None:
    prompts = rand_prompts([9, 30], 49152, seed=2)
    compare(tp2, None, prompts, 6, chunked_prefill_size=16, max_total_tokens=1024)


def _followers_sample_otherwise(tp: TPGroup, driver: InProcessDriver) -> None:
    """On ranks other than 0, every sampled id is shifted by one: as if they rounded
    differently. Rank 0's ids must still be what every rank feeds back."""
    if tp.rank == 0:
        return
    sampler = driver.worker.model_runner.sampler
    sample = sampler.forward

    def shifted(*args: Any, **kwargs: Any) -> Any:
        out = sample(*args, **kwargs)
        out.next_token_ids = (out.next_token_ids + 1) % VOCAB
        return out

    sampler.forward = shifted
    # Argmax-only batches skip the sampler: shift the worker's argmax too.
    from managers import model_worker

    argmax = model_worker.greedy_ids
    model_worker.greedy_ids = lambda logits: (argmax(logits) + 1) % VOCAB


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_followers_take_rank_0_ids(
    tp2: TPRanks, tiny_models: dict[str, str], overlap: bool
) -> None:
    # With overlap, rank 1's next inputs are future-token placeholders resolved on the
    # forward thread: they must resolve to rank 0's ids, not to what rank 1 sampled.
    prompts = rand_prompts([7, 19], VOCAB, seed=5)
    args = {"disable_overlap_schedule": not overlap, "max_total_tokens": 1024}
    ref = generate(TPGroup.single(), tiny_models["llama"], prompts, 8, **args)
    ranks = tp2.run(generate, tiny_models["llama"], prompts, 8, _followers_sample_otherwise, **args)
    # Every id rank 1 sampled differed: 8 per request, plus, in the overlap loop, the
    # forward it launches before it sees that the requests finished.
    assert ranks[0]["mismatches"] == 0
    if overlap:
        assert ranks[1]["mismatches"] >= 2 * 8
    else:
        assert ranks[1]["mismatches"] == 2 * 8
    for r in ranks:
        r["mismatches"] = 0
    assert_tp_greedy_equal(ref, ranks)
