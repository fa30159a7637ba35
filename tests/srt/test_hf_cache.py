"""`--model-path Org/Name` served from the local Hugging Face cache, offline: the snapshot
`refs/main` names is found under HF_HUB_CACHE (or HF_HOME/hub), and a model id that is not
cached is a clear error naming where it looked."""

from __future__ import annotations

from pathlib import Path

import pytest

from srt.model_loader import ModelNotFoundError
from srt.model_loader.sources import get_tokenizer, resolve_model_path
from tests.engine.tiny_models import save_tiny_model


def fake_hub_cache(root: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The layout `huggingface-cli download` leaves: models--Org--Name/{refs,snapshots}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    save_tiny_model("llama", snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_model_id_resolves_to_the_cached_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/Tiny-Llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert Path(resolve_model_path("tiny-org/Tiny-Llama")) == snapshot
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the same folder
    assert Path(resolve_model_path("tiny-org/Tiny-Llama")) == snapshot


def test_an_uncached_model_id_names_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("some-org/Not-Here")
    message = str(err.value)
    assert str(tmp_path / "empty-hub") in message and "huggingface-cli download" in message


def test_tokenizer_of_a_cached_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_path: str
) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/With-Tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((Path(default_model_path) / name).read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tokenizer = get_tokenizer("tiny-org/With-Tokenizer")
    assert tokenizer.decode(tokenizer.encode("Hello world")).endswith("Hello world")
