"""Model loading: default model discovery, GGUF -> HF conversion, weights, tokenizer."""

from __future__ import annotations

from srt.model_loader.default_model import ModelNotFoundError, find_default_gguf
from srt.model_loader.gguf_convert import cache_root, convert_gguf
from srt.model_loader.loader import (
    get_model,
    get_tokenizer,
    iterate_safetensors,
    resolve_model_path,
)

__all__ = [
    "ModelNotFoundError",
    "cache_root",
    "convert_gguf",
    "find_default_gguf",
    "get_model",
    "get_tokenizer",
    "iterate_safetensors",
    "resolve_model_path",
]
