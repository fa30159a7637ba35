"""Weights kept quantized (`--quantization`), through the whole path a `--model-path x.gguf`
takes: tiny GGUF files with Q4_0 / Q4_1 / Q8_0 matrices (`tiny_gguf.save_tiny_gguf(quant=...)`),
converted, loaded and served by the scheduler.

The layers must hold exactly the file's weights (each quantized layer dequantizes to the
float model's weight, which `--quantization none` loads from the same file), in this rank's
rows and columns; the engine's outputs must stay close to the float model's (the inputs of
each matmul are rounded to int8 per block of 32, as llama.cpp rounds them), and the overlap
and normal loops must give the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from managers.inprocess import InProcessDriver
from srt.configs.model_config import ModelConfig
from srt.kernels.quant import quant_linear_kernel
from srt.layers.quantization import resolve_quantization
from srt.model_loader.gguf_convert import convert_gguf
from srt.model_loader.loader import get_model
from srt.server_args import ServerArgs
from tests.engine.shared_worker import release
from tests.engine.tiny_gguf import save_tiny_gguf
from tests.engine.tiny_models import VOCAB

pytestmark = pytest.mark.skipif(quant_linear_kernel() is None, reason="no C compiler / x86")

# llama: q/k rows reordered by llama.cpp, a tied Q8_0 embedding as the LM head, one Q4_0
# matrix among Q4_1 ones; qwen2: q/k/v biases, an untied LM head.
QUANT = {
    "llama": {"token_embd": "Q8_0", "blk.1.ffn_down": "Q4_0", "": "Q4_1"},
    "qwen2": {"output": "Q8_0", "blk.0.attn_v": "Q8_0", "": "Q4_1"},
}


@pytest.fixture(scope="module", params=sorted(QUANT))
def gguf_file(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    return arch, save_tiny_gguf(arch, folder, quant=QUANT[arch])


def _config(path: Path, tmp: Path) -> ModelConfig:
    return ModelConfig.from_path(str(convert_gguf(path, cache_dir=tmp)))


def test_layers_hold_exactly_the_files_weights(gguf_file, tmp_path) -> None:
    arch, path = gguf_file
    config = _config(path, tmp_path)
    dense = dict(get_model(config, quantization="none").named_modules())
    model = get_model(config, quantization="gguf")
    kinds = {}
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if quant is None:
            continue
        kinds[name] = quant.kind
        rows = quant.rows(torch.arange(quant.shape[0]))
        assert torch.equal(rows, dense[name].weight), name
        assert module.weight.device.type == "meta"  # no float copy kept
    if arch == "llama":
        # the tied table is the LM head's panels; a layer mixing types stays float
        assert kinds["model.embed_tokens"] == kinds["lm_head"] == "Q8_0"
        assert kinds["model.layers.1.mlp.down_proj"] == "Q4_0"
        assert kinds["model.layers.0.self_attn.qkv_proj"] == "Q4_1"
    else:
        assert kinds["lm_head"] == "Q8_0" and "model.embed_tokens" not in kinds
        assert "model.layers.0.self_attn.qkv_proj" not in kinds  # q, k Q4_1 with a Q8_0 v
        assert kinds["model.layers.1.self_attn.qkv_proj"] == "Q4_1"
        assert model.model.layers[1].self_attn.qkv_proj.quant.bias is not None


def test_the_first_load_keeps_the_matched_blocks(gguf_file, tmp_path, monkeypatch) -> None:
    """Later loads read the blocks the first one matched, not the GGUF file's metadata."""
    from srt.model_loader import gguf_quant

    _, path = gguf_file
    config = _config(path, tmp_path)
    first = get_model(config, quantization="gguf")
    assert (Path(config.model_path) / gguf_quant.BLOCKS_FILE).is_file()

    def not_again(*args):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf_quant, "GGUFBlocks", not_again)
    second = get_model(config, quantization="gguf")
    for (name, a), (_, b) in zip(first.named_modules(), second.named_modules(), strict=True):
        if getattr(a, "quant", None) is not None:
            assert torch.equal(a.quant.panels, b.quant.panels), name


def test_int8_and_int4_quantize_a_float_checkpoint(gguf_file, tmp_path) -> None:
    _, path = gguf_file
    config = _config(path, tmp_path)
    dense = dict(get_model(config, quantization="none").named_modules())
    for method, step in (("int8", 1 / 127), ("int4", 1 / 15)):
        model = get_model(config, quantization=method)
        quantized = [(n, m) for n, m in model.named_modules() if getattr(m, "quant", None)]
        assert len(quantized) >= 9
        for name, module in quantized:
            w = dense[name].weight
            rows = module.quant.rows(torch.arange(w.shape[0]))
            # within one step of the block's range (half a step, and float16 scales)
            assert (rows - w).abs().max() <= step * 2 * w.abs().max(), name


def _driver(path: Path, tmp: Path, **args) -> InProcessDriver:
    server_args = ServerArgs(
        model_path=str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_total_tokens=4096,
        cache_dir=str(tmp),
        **args,
    )
    return InProcessDriver(server_args)


def test_outputs_stay_close_to_the_float_model_in_both_loops(gguf_file, tmp_path) -> None:
    _, path = gguf_file
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in (5, 17, 40)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    fields = {"return_logprob": True, "logprob_start_len": 0}
    outputs = {}
    for quantization, overlap in (("none", False), ("gguf", False), ("gguf", True)):
        driver = _driver(
            path, tmp_path, quantization=quantization, disable_overlap_schedule=not overlap
        )
        assert driver.worker.model_runner.quantization == quantization
        outputs[quantization, overlap] = driver.generate(prompts, params, **fields)
        release(driver)
    ours, ref = [], []
    for dense, normal, overlap in zip(
        outputs["none", False], outputs["gguf", False], outputs["gguf", True], strict=True
    ):
        assert normal["output_ids"] == overlap["output_ids"]
        ours += [lp for lp, *_ in normal["meta_info"]["input_token_logprobs"][1:]]
        ref += [lp for lp, *_ in dense["meta_info"]["input_token_logprobs"][1:]]
    # Close next to how much the prompt's log-probabilities vary: a layer with wrong weights
    # moves them by about that much.
    error, spread = (torch.tensor(ours) - torch.tensor(ref)).abs(), torch.tensor(ref).std()
    assert error.max() < 0.25 * spread and error.mean() < 0.03 * spread, (error, spread)


def test_auto_keeps_a_gguf_quantized_on_cpu_only() -> None:
    assert resolve_quantization("auto", is_gguf=True, device="cpu") == "gguf"
    assert resolve_quantization("auto", is_gguf=False, device="cpu") == "none"
    assert resolve_quantization("auto", is_gguf=True, device="cuda") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", is_gguf=False, device="cuda")
    with pytest.raises(ValueError, match="needs a .gguf"):
        resolve_quantization("gguf", is_gguf=False, device="cpu")


def test_the_default_model_serves_its_q4_1_file_quantized(default_hf_reference) -> None:
    """The default model under `auto`: every matmul and the tied table kept as the shipped
    file stores them (Q4_1, and Q8_0 for the table), 98 MB of weights; its greedy text
    follows the float32 model's (HF's on the dequantized file): each prompt's first tokens
    equal, and on average most of 16 (int8 inputs move a near-tie now and then)."""
    driver = InProcessDriver(ServerArgs(max_total_tokens=4096))
    runner = driver.worker.model_runner
    assert runner.quantization == "gguf"
    kinds = [m.quant.kind for m in runner.model.modules() if getattr(m, "quant", None)]
    assert kinds.count("Q4_1") == 30 * 4 and kinds.count("Q8_0") == 2  # the head and table
    assert runner.model.model.embed_tokens.quant is runner.model.lm_head.quant
    prompts = default_hf_reference.prompts
    outs = driver.generate(
        list(prompts.values()), {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    shares = []
    for text, out in zip(prompts, outs, strict=True):
        ref = default_hf_reference.refs[text][:16]
        same = next((i for i, (a, b) in enumerate(zip(out["output_ids"], ref)) if a != b), 16)
        assert same >= 2, (text, out["text"])
        shares.append(same / 16)
    assert sum(shares) / len(shares) >= 0.5, shares
    release(driver)
