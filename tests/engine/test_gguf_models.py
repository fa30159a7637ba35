"""GGUF files of each served architecture, through the whole path a `--model-path x.gguf`
takes (conversion to an HF folder, then the scheduler and the model).

Each tiny file (`tests/engine/tiny_gguf.py`) is written once per module, as llama.cpp's
converter writes it, from a tiny random model set to what the format can express; HF on that
source model is the reference. Greedy tokens of the served file must equal HF's, and the
converted config must keep what the source model's does: this is what checks the settings
`gguf_config` restores where transformers' GGUF reader drops them (Llama 3's RoPE scaling,
Gemma's soft-caps and score scale, Gemma 3's global RoPE scaling, Phi-3's rotary width,
window and LongRoPE, the experts' width of Qwen3-MoE). Files whose weights transformers
cannot all place are refused rather than served with random ones.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.model_loader import gguf_config, gguf_convert
from srt.server_args import ServerArgs
from tests.engine.hf_reference import NEAR_TIE
from tests.engine.shared_worker import release
from tests.engine.tiny_gguf import save_tiny_gguf
from tests.engine.tiny_models import VOCAB

NEW_TOKENS = 16
# Two of them longer than the windows (8) of Gemma and the Phi-3 below (a Mistral file has
# none: llama.cpp writes it as a Llama).
PROMPT_LENGTHS = (3, 11, 29)
# Phi-3-mini-4k has a window (llama.cpp writes it, transformers' reader drops it), and so
# does the tiny Phi-3 here.
OVERRIDES = {"phi3": {"sliding_window": 8}}
ARCHS = ["llama", "qwen2", "mistral", "qwen3-moe", "gemma2", "gemma3", "phi3"]
# Those whose files transformers' own reader turns into the source model.
READ_WHOLE_BY_TRANSFORMERS = ["qwen2", "mistral"]
# What must survive the conversion, where the source config has it.
KEPT = (
    "max_position_embeddings",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "sliding_window",
    "layer_types",
    "rope_parameters",
    "original_max_position_embeddings",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp_only_layers",
)


@dataclass
class Served:
    arch: str
    gguf: Path
    source: Path  # the HF folder the file was written from
    converted: Path
    prompts: list[list[int]]
    outputs: list[list[int]]


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tmp_path_factory) -> Served:
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    gguf = save_tiny_gguf(arch, folder, **OVERRIDES.get(arch, {}))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in PROMPT_LENGTHS]
    args = ServerArgs(
        model_path=str(gguf),
        cache_dir=str(folder / "cache"),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        max_total_tokens=2048,
    )
    driver = InProcessDriver(args)
    try:
        outs = driver.generate(
            prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        )
        driver.scheduler.check_memory()
    finally:
        release(driver)
    converted = gguf_convert.converted_folder(gguf, folder / "cache")
    outputs = [o["output_ids"] for o in outs]
    return Served(arch, gguf, folder / "hf", converted, prompts, outputs)


def _load_hf(source: Path | Served):
    from transformers import AutoModelForCausalLM

    if isinstance(source, Served):  # transformers' own reading of the file
        return AutoModelForCausalLM.from_pretrained(
            source.gguf.parent, gguf_file=source.gguf.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def _assert_greedy_equal(served: Served, hf) -> None:
    """HF greedy would have chosen each of our tokens after the ones before it: one forward
    over the prompt and our output checks all of them (instead of HF generating them one by
    one), but after a genuine near-tie in HF's logits, where the two may part."""
    for prompt, ours in zip(served.prompts, served.outputs, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1 :].float()
        for pos, token in enumerate(ours):
            top2 = torch.topk(logits[pos], 2)
            if int(top2.indices[0]) == token:
                continue
            gap = float(top2.values[0] - logits[pos, token])
            assert gap < NEAR_TIE, (
                f"output position {pos}: ours {token}, HF {int(top2.indices[0])}, "
                f"HF logit gap {gap:.3g} is not a near-tie"
            )
            break


def test_served_gguf_equals_hf_on_its_source_model(served: Served) -> None:
    _assert_greedy_equal(served, _load_hf(served.source))


def test_served_gguf_equals_hf_reading_the_file(served: Served) -> None:
    if served.arch not in READ_WHOLE_BY_TRANSFORMERS:
        pytest.skip(
            "transformers' own reading of these files misses settings gguf_convert restores"
        )
    _assert_greedy_equal(served, _load_hf(served))


def test_converted_config_keeps_the_model(served: Served) -> None:
    source = json.loads((served.source / "config.json").read_text())
    converted = json.loads((served.converted / "config.json").read_text())
    # llama.cpp converts Mistral as Llama: the same model, the window aside (see tiny_gguf).
    expected_arch = ["LlamaForCausalLM"] if served.arch == "mistral" else source["architectures"]
    assert converted["architectures"] == expected_arch
    assert converted["rms_norm_eps"] == pytest.approx(source["rms_norm_eps"])
    source.get("rope_parameters", {}).pop("type", None)  # the legacy name of rope_type
    for key in KEPT:
        if key in source:
            assert converted.get(key) == source[key], key


@pytest.mark.parametrize(
    ("arch", "leave_out", "first_missing"),
    [
        # Qwen2 attention without its biases.
        ("qwen2", ("attn_q.bias", "attn_k.bias", "attn_v.bias"), "q_proj.bias"),
        # Mixtral, a Llama-arch file with experts, which transformers reads as a dense Llama.
        ("mixtral", (), "mlp.down_proj"),
    ],
)
def test_a_file_without_weights_its_model_needs_is_refused(
    tmp_path: Path, arch: str, leave_out: tuple[str, ...], first_missing: str
) -> None:
    """Not served with the weights transformers would start at random."""
    gguf = save_tiny_gguf(arch, tmp_path, leave_out=leave_out)
    with pytest.raises(RuntimeError, match=rf"holds no tensor for .*{first_missing}"):
        gguf_convert.convert_gguf(gguf, tmp_path / "cache")
    assert not gguf_convert.converted_folder(gguf, tmp_path / "cache").exists()


# Llama 3.2 1B / 3B and Llama 3.1 8B.
@pytest.mark.parametrize(("factor", "head_dim"), [(32.0, 64), (8.0, 128)])
def test_llama3_scaling_is_recovered_from_rope_freqs(factor: float, head_dim: int) -> None:
    """What the tiny Llama cannot show (its band holds one frequency): a band to fit."""
    expected = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    wavelengths = 2 * np.pi * 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    divisors = gguf_config._llama3_divisors(wavelengths, expected).astype(np.float32)
    assert gguf_config._llama3_scaling(divisors.astype(np.float64), wavelengths) == expected
    with pytest.raises(RuntimeError, match="fit no Llama 3 RoPE scaling"):
        gguf_config._llama3_scaling(divisors[::-1].astype(np.float64), wavelengths)
