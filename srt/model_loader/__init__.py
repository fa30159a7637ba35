"""Model loading: default model discovery (`default_model`), GGUF -> HF conversion
(`gguf_convert`), paths and tokenizers (`sources`, no torch), weights (`loader`).

The names below are imported from their submodule on first use, so a process that only
resolves a path or loads a tokenizer does not import torch.
"""

from __future__ import annotations

from srt.utils.lazy import lazy_exports

_SUBMODULE = {
    "ModelNotFoundError": "srt.model_loader.default_model",
    "find_default_gguf": "srt.model_loader.default_model",
    "cache_root": "srt.model_loader.gguf_convert",
    "convert_gguf": "srt.model_loader.gguf_convert",
    "get_tokenizer": "srt.model_loader.sources",
    "resolve_model_path": "srt.model_loader.sources",
    "get_model": "srt.model_loader.loader",
    "iterate_safetensors": "srt.model_loader.loader",
}

__getattr__ = lazy_exports(__name__, _SUBMODULE)
