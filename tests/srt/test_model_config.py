"""Tests for srt.configs: dtype resolution and ModelConfig on tiny local configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srt.configs import dtype as dtype_mod
from srt.configs.dtype import cpu_flags, resolve_dtype, to_torch_dtype
from srt.configs.model_config import ModelConfig

# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize(
    ("name", "expected"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.float16, "cpu") == expected
    assert resolve_dtype(name.upper(), None, "cuda") == expected


def test_unknown_dtype_raises() -> None:
    with pytest.raises(ValueError, match="Unknown dtype"):
        resolve_dtype("int8", None, "cpu")


@pytest.mark.parametrize(
    ("config_dtype", "expected"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_auto_on_cuda(
    monkeypatch: pytest.MonkeyPatch, config_dtype: torch.dtype | None, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", config_dtype, "cuda") == expected
    assert resolve_dtype("auto", config_dtype, "cuda:1") == expected


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("config_dtype", [torch.float32, torch.bfloat16, torch.float16, None])
def test_auto_on_cpu(
    monkeypatch: pytest.MonkeyPatch, fast: bool, config_dtype: torch.dtype | None
) -> None:
    monkeypatch.setattr(dtype_mod, "cpu_has_fast_bf16", lambda: fast)
    # The config's dtype where the CPU runs it fast (bf16 with native support), else fp32.
    expected = torch.bfloat16 if fast and config_dtype == torch.bfloat16 else torch.float32
    assert resolve_dtype("auto", config_dtype, "cpu") == expected


def test_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx512f", "avx512_bf16"} <= cpu_flags(info)
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert isinstance(dtype_mod.cpu_has_fast_bf16(), bool)


@pytest.mark.parametrize(("isa", "capped"), [("AVX2", True), ("avx512_core", True), ("", False)])
def test_onednn_isa_cap_turns_fast_bf16_off(
    monkeypatch: pytest.MonkeyPatch, isa: str, capped: bool
) -> None:
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 makes bf16 matmuls slow: auto avoids them."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    dtype_mod.cpu_has_fast_bf16.cache_clear()
    try:
        monkeypatch.setattr(dtype_mod, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
        assert dtype_mod.cpu_has_fast_bf16() is not capped
    finally:
        dtype_mod.cpu_has_fast_bf16.cache_clear()


def test_to_torch_dtype() -> None:
    assert to_torch_dtype("bfloat16") == torch.bfloat16
    assert to_torch_dtype("torch.float16") == torch.float16
    assert to_torch_dtype(torch.float32) == torch.float32
    assert to_torch_dtype(None) is None


# ---------------------------------------------------------------- ModelConfig


def _write_config(folder: Path, model_type: str, **kwargs: object) -> Path:
    from transformers import AutoConfig

    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **kwargs).save_pretrained(folder)
    return folder


def test_llama_config(tmp_path: Path) -> None:
    folder = _write_config(
        tmp_path / "llama",
        "llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=512,
        eos_token_id=2,
        dtype="bfloat16",
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    cfg = ModelConfig.from_path(str(folder), dtype="float32")
    assert cfg.model_path == str(folder)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.dtype == torch.float32
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (64, 16, 100)
    assert cfg.context_len == 512
    assert cfg.eos_token_ids == [2, 7, 9]
    assert cfg.hf_config.model_type == "llama"
    assert ModelConfig.from_path(str(folder), dtype="auto", device="cuda").dtype == torch.bfloat16


def test_qwen2_config_context_override(tmp_path: Path) -> None:
    folder = _write_config(
        tmp_path / "qwen2",
        "qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=4096,
        eos_token_id=[5, 6],
    )
    cfg = ModelConfig.from_path(str(folder), dtype="bfloat16", context_length=1024)
    assert cfg.context_len == 1024
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 16)
    assert cfg.eos_token_ids == [5, 6]
    assert cfg.dtype == torch.bfloat16


def test_qwen3_explicit_head_dim(tmp_path: Path) -> None:
    folder = _write_config(
        tmp_path / "qwen3",
        "qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=200,
        max_position_embeddings=2048,
    )
    cfg = ModelConfig.from_path(str(folder), dtype="float32")
    assert cfg.head_dim == 32  # not hidden / heads = 16
    assert cfg.num_key_value_heads == 1
    assert cfg.context_len == 2048


def test_missing_architectures_raises(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "noarch", "llama", hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_path(str(folder))


@pytest.mark.slow
def test_default_model_config() -> None:
    from srt.model_loader.default_model import ModelNotFoundError

    try:  # the shared converted folder (test_model_loader.py tests converting afresh)
        cfg = ModelConfig.from_path(None, dtype="float32")
    except ModelNotFoundError:
        pytest.skip("default model not installed")
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 9, 3)
    assert (cfg.head_dim, cfg.vocab_size, cfg.context_len) == (64, 49152, 8192)
    assert cfg.eos_token_ids == [2]
