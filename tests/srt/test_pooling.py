"""An embedding server's pooling: what it reads from a model folder
(`srt/configs/pooling.py`) and how chunk parts combine (`srt/layers/pooler.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from srt.configs.pooling import PoolingConfig, read_pooling_config
from srt.layers.pooler import add_part, finish_vector, pool_parts, pooled_rows

HF_CONFIG = {"hidden_size": 8}


def _modules(folder: Path, *kinds: str, pooling: dict | None = None) -> Path:
    modules = [
        {
            "idx": i,
            "name": str(i),
            "path": f"{i}_{kind}",
            "type": f"sentence_transformers.models.{kind}",
        }
        for i, kind in enumerate(kinds)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    for i, kind in enumerate(kinds):
        (folder / f"{i}_{kind}").mkdir()
        if kind == "Pooling":
            (folder / f"{i}_{kind}" / "config.json").write_text(json.dumps(pooling or {}))
    return folder


def test_a_folder_without_sentence_transformers_files_pools_the_last_token(tmp_path: Path) -> None:
    config = read_pooling_config(tmp_path, HF_CONFIG)
    assert config == PoolingConfig("last", True, 8, ())
    assert not config.every_token()


@pytest.mark.parametrize(
    ("flag", "method"),
    [
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_cls_token", "cls"),
    ],
)
def test_the_pooling_module_picks_the_method(tmp_path: Path, flag: str, method: str) -> None:
    _modules(
        tmp_path, "Transformer", "Pooling", pooling={flag: True, "pooling_mode_max_tokens": False}
    )
    config = read_pooling_config(tmp_path, HF_CONFIG)
    assert (config.method, config.normalize) == (method, False)
    assert config.every_token() == (method != "last")


@pytest.mark.parametrize(
    ("kinds", "pooling", "error"),
    [
        (("Transformer", "Pooling", "Dense"), {"pooling_mode_mean_tokens": True}, "'Dense'"),
        (("Transformer", "Pooling"), {"pooling_mode_max_tokens": True}, "max_tokens"),
        (
            ("Transformer", "Pooling"),
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "exactly one",
        ),
        (("Transformer", "Normalize"), None, "no Pooling module"),
    ],
)
def test_modules_it_cannot_run_are_refused(
    tmp_path: Path, kinds: tuple[str, ...], pooling: dict | None, error: str
) -> None:
    _modules(tmp_path, *kinds, pooling=pooling)
    with pytest.raises(ValueError, match=error):
        read_pooling_config(tmp_path, HF_CONFIG)


def test_dimensions_only_where_the_model_was_trained_for_them(tmp_path: Path) -> None:
    plain = read_pooling_config(tmp_path, HF_CONFIG)
    assert plain.check_dimensions(None) is None
    assert "Matryoshka" in plain.check_dimensions(4)
    sizes = read_pooling_config(tmp_path, {**HF_CONFIG, "matryoshka_dimensions": [4, 8]})
    assert sizes.check_dimensions(4) is None and "4, 8" in sizes.check_dimensions(6)
    free = read_pooling_config(tmp_path, {**HF_CONFIG, "is_matryoshka": True})
    assert free.check_dimensions(6) is None and "[1, 8]" in free.check_dimensions(9)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_parts_of_chunks_combine_to_the_whole_prompt(method: str) -> None:
    """Two requests, the first run as chunks of 3 and 2 tokens: the combined parts equal the
    one-forward pooling of its 5 hidden states."""
    torch.manual_seed(0)
    hidden = torch.randn(5, 4)
    expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]

    def run(rows: torch.Tensor, lens: list[int], prefix: int, acc: torch.Tensor | None):
        batch = SimpleNamespace(extend_seq_lens=torch.tensor(lens))
        keep = pooled_rows(method, batch)
        parts = pool_parts(method, rows if keep is None else rows[keep], batch)
        return add_part(method, acc, parts[0], prefix)

    other = torch.randn(2, 4)  # a second request in the first chunk's batch
    acc = run(torch.cat([hidden[:3], other]), [3, 2], 0, None)
    acc = run(hidden[3:], [2], 3, acc)
    vector = finish_vector(method, acc, 5, None, normalize=False)
    torch.testing.assert_close(torch.tensor(vector), expected)
    unit = finish_vector(method, acc, 5, 2, normalize=True)
    torch.testing.assert_close(
        torch.tensor(unit), torch.nn.functional.normalize(expected[:2], dim=0)
    )
