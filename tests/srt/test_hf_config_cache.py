"""The config snapshot a scheduler starts from after a folder's first load
(`srt/configs/hf_config_cache.py`): for every architecture served, each attribute transformers'
config has (class defaults, derived fields, aliases) reads back equal, and a start from a
snapshot imports no configuration module."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from srt.configs import hf_config_cache
from srt.configs.hf_config_cache import ConfigSnapshot, load_hf_config
from tests.engine.tiny_models import tiny_config

ARCHS = [
    "llama", "qwen2", "qwen2-window", "qwen3", "mistral", "phi3", "phi3-long", "qwen3-moe",
    "mixtral", "gemma2", "gemma3",
]  # fmt: skip


def config_folder(folder: Path, arch: str, architectures: list[str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch)
    if architectures is not None:
        config.architectures = architectures
    config.save_pretrained(folder)
    return folder


def attributes(config: Any) -> dict[str, Any]:
    """Every non-method attribute of `config`, as transformers' own config answers it."""
    out = {}
    for name in dir(config):
        if name.startswith("__") or name in hf_config_cache._NOT_SNAPSHOTTED:
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001, S112 - a property that does not apply
            continue
        if not callable(value) or isinstance(value, type):
            out[name] = value
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_a_snapshot_reads_back_what_transformers_read(arch: str, tmp_path: Path) -> None:
    folder = config_folder(tmp_path / "model", arch)
    real = load_hf_config(str(folder), tmp_path / "cache")
    assert not isinstance(real, ConfigSnapshot)
    snap = load_hf_config(str(folder), tmp_path / "cache")
    assert isinstance(snap, ConfigSnapshot)

    expected = attributes(real)
    assert {"vocab_size", "rope_parameters", "model_type", "architectures"} <= expected.keys()
    for name, value in expected.items():
        got = getattr(snap, name)
        assert got == value and type(got) is type(value), name
    for alias, target in real.attribute_map.items():
        assert getattr(snap, alias) == getattr(real, alias) == getattr(real, target)
    assert snap.to_dict() == real.to_dict()
    assert snap.get_text_config() is snap
    with pytest.raises(AttributeError):
        _ = snap.no_such_setting
    assert getattr(snap, "no_such_setting", None) is None


def test_the_default_model_reads_back_equal(default_model_path: str, tmp_path: Path) -> None:
    real = load_hf_config(default_model_path, tmp_path)
    snap = load_hf_config(default_model_path, tmp_path)
    assert isinstance(snap, ConfigSnapshot)
    assert {k: getattr(snap, k) for k in attributes(real)} == attributes(real)


def test_the_same_file_in_another_folder_names_that_folder(tmp_path: Path) -> None:
    first = config_folder(tmp_path / "first", "llama")
    second = tmp_path / "second"
    second.mkdir()
    (second / "config.json").write_bytes((first / "config.json").read_bytes())
    load_hf_config(str(first), tmp_path / "cache")
    snap = load_hf_config(str(second), tmp_path / "cache")
    assert isinstance(snap, ConfigSnapshot)
    assert snap.name_or_path == snap._name_or_path == str(second)


def test_an_edited_config_or_another_transformers_is_read_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = config_folder(tmp_path / "model", "llama")
    load_hf_config(str(folder), tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(config))
    edited = load_hf_config(str(folder), tmp_path / "cache")
    assert not isinstance(edited, ConfigSnapshot) and edited.rms_norm_eps == 1e-3
    assert load_hf_config(str(folder), tmp_path / "cache").rms_norm_eps == 1e-3

    import transformers

    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    assert not isinstance(load_hf_config(str(folder), tmp_path / "cache"), ConfigSnapshot)


def test_a_nested_config_is_never_snapshotted(tmp_path: Path) -> None:
    """A multimodal Gemma 3 checkpoint's config: the text model's inside it."""
    from transformers import Gemma3Config, SiglipVisionConfig

    folder = tmp_path / "model"
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config = Gemma3Config(
        text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict()
    )
    config.save_pretrained(folder)
    for _ in range(2):
        config = load_hf_config(str(folder), tmp_path / "cache")
        assert not isinstance(config, ConfigSnapshot)
        assert config.get_text_config() is not config
    assert not (tmp_path / "cache" / "hf-configs").exists()


def test_a_damaged_or_foreign_snapshot_is_not_used(tmp_path: Path) -> None:
    folder = config_folder(tmp_path / "model", "qwen3")
    load_hf_config(str(folder), tmp_path / "cache")
    [path] = (tmp_path / "cache" / "hf-configs").iterdir()

    path.write_bytes(b"not a pickle")
    assert not isinstance(load_hf_config(str(folder), tmp_path / "cache"), ConfigSnapshot)
    assert isinstance(load_hf_config(str(folder), tmp_path / "cache"), ConfigSnapshot)

    # A file naming any callable besides a dtype is refused before it is called.
    path.write_bytes(pickle.dumps(({"model_type": Path("/")}, {})))
    with pytest.raises(pickle.UnpicklingError):
        hf_config_cache._PlainUnpickler(path.open("rb")).load()
    assert not isinstance(load_hf_config(str(folder), tmp_path / "cache"), ConfigSnapshot)


START_FROM_SNAPSHOT = """
import sys
from srt.configs.model_config import ModelConfig
config = ModelConfig.from_path(sys.argv[1], cache_dir=sys.argv[2])
print(type(config.hf_config).__name__, config.num_hidden_layers, config.sliding_window)
loaded = [m for m in sys.modules if ".configuration_" in m and m.startswith("transformers.models")]
print(sorted(loaded), "torch.distributed.tensor" in sys.modules)
"""


def test_a_start_from_a_snapshot_imports_no_configuration_module(tmp_path: Path) -> None:
    folder = config_folder(tmp_path / "model", "qwen2-window", ["Qwen2ForCausalLM"])
    load_hf_config(str(folder), tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", START_FROM_SNAPSHOT, str(folder), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    window = tiny_config("qwen2-window")
    assert out[0] == f"ConfigSnapshot {window.num_hidden_layers} {window.sliding_window}"
    assert out[1] == "[] False"
