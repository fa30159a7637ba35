"""Model configuration and dtype resolution."""

from __future__ import annotations

from srt.configs.dtype import resolve_dtype
from srt.configs.model_config import ModelConfig

__all__ = ["ModelConfig", "resolve_dtype"]
