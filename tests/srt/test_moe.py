"""The grouped expert path (`SparseMoE.forward`) equals the per-token reference, and routes as
HF does (softmax in float32, top-k, renormalised or not)."""

from __future__ import annotations

import pytest
import torch

from srt.layers.moe import DOWN, GATE, UP, SparseMoE


def _moe(renormalize: bool, dtype: torch.dtype = torch.float32) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(64, 48, num_experts=8, top_k=2, renormalize=renormalize)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    return moe.to(dtype)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_grouped_equals_per_token(renormalize: bool, tokens: int) -> None:
    moe = _moe(renormalize)
    x = torch.randn(tokens, 64)
    torch.testing.assert_close(moe(x), moe.forward_per_token(x), rtol=1e-5, atol=1e-5)


def test_grouped_equals_per_token_bfloat16() -> None:
    moe = _moe(True, torch.bfloat16)
    x = torch.randn(16, 64).to(torch.bfloat16)
    torch.testing.assert_close(
        moe(x).float(), moe.forward_per_token(x).float(), rtol=2e-2, atol=2e-2
    )


def test_routing_as_hf() -> None:
    moe = _moe(False)
    x = torch.randn(5, 64)
    weights, ids = moe.route(x)
    probs = torch.softmax(x @ moe.gate.weight.t(), dim=-1)
    top = probs.topk(2, dim=-1)
    torch.testing.assert_close(weights, top.values)
    assert torch.equal(ids, top.indices)
    renorm = _moe(True)
    w, _ = renorm.route(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def test_experts_load_by_part() -> None:
    moe = SparseMoE(8, 6, num_experts=2, top_k=1, renormalize=False)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    for part, t in ((GATE, gate), (UP, up), (DOWN, down)):
        moe.load_expert(1, part, t)
    assert torch.equal(moe.w13[1], torch.cat([gate, up])) and torch.equal(moe.w2[1], down)


@pytest.mark.parametrize("tokens", [1, 9, 70])  # small rows take the panels, 70 the library
def test_packed_experts_equal_the_plain_weights(tokens: int) -> None:
    moe = _moe(True)
    x = torch.randn(tokens, 64)
    with torch.inference_mode():
        plain = moe(x)
        assert moe.pack_for_cpu() and len(moe.packed_weights()) == 16
        torch.testing.assert_close(moe(x), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "expected"), [("qwen3-moe", "SparseMoE"), ("qwen3", None)])
def test_moe_models_keep_decode_graphs_off(arch: str, expected: str | None, tmp_path) -> None:
    """The expert path reads its group sizes on the host, which a CUDA graph cannot
    capture: the runner must find the layer (and so never capture one) in a MoE model."""
    from srt.configs.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs
    from tests.engine.tiny_models import save_tiny_model

    folder = save_tiny_model(arch, tmp_path)
    args = ServerArgs(model_path=str(folder), device="cpu", dtype="float32",
                      skip_tokenizer_init=True, max_total_tokens=512)  # fmt: skip
    runner = ModelRunner(ModelConfig.from_path(str(folder), dtype="float32"), args)
    assert runner.uncapturable_layer() == expected
