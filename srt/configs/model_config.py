"""``ModelConfig``: the facts about a model that the runtime needs, read from a local folder.

Built once per process by ``ModelConfig.from_path``; the KV pool sizes itself from
``num_key_value_heads`` / ``head_dim`` / ``num_hidden_layers``, the scheduler caps requests
at ``context_len``, and ``eos_token_ids`` finish generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from srt.configs.dtype import resolve_dtype, to_torch_dtype

logger = logging.getLogger(__name__)

# Config keys that carry the trained context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
_FALLBACK_CONTEXT_LEN = 2048


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    hf_config: Any  # transformers.PretrainedConfig, or a ConfigSnapshot of one
    architectures: list[str]
    dtype: torch.dtype
    context_len: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: list[int]
    # The attention window of the model's windowed layers (None: every layer sees all).
    sliding_window: int | None = None

    @classmethod
    def from_path(
        cls,
        model_path: str | None,
        dtype: str = "auto",
        context_length: int | None = None,
        cache_dir: str | None = None,
        device: str = "cpu",
    ) -> ModelConfig:
        """Resolve ``model_path`` (None = default model, .gguf, or HF folder) and read it."""
        from srt.configs.hf_config_cache import load_hf_config
        from srt.model_loader.sources import resolve_model_path

        folder = resolve_model_path(model_path, cache_dir)
        hf_config = load_hf_config(folder, cache_dir)
        text = hf_config.get_text_config()

        config_dtype = to_torch_dtype(
            getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        )
        num_heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        head_dim = getattr(text, "head_dim", None) or hidden // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        architectures = list(getattr(hf_config, "architectures", None) or [])
        if not architectures:
            raise ValueError(f"{folder}/config.json lists no architectures")

        return cls(
            model_path=folder,
            hf_config=hf_config,
            architectures=architectures,
            dtype=resolve_dtype(dtype, config_dtype, device),
            context_len=_context_len(text, context_length),
            num_hidden_layers=int(text.num_hidden_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            hidden_size=hidden,
            vocab_size=int(text.vocab_size),
            eos_token_ids=_eos_token_ids(folder, hf_config),
            sliding_window=model_sliding_window(text),
        )


def layer_sliding_window(config: Any, layer_id: int) -> int | None:
    """How many positions layer `layer_id` attends to (itself included), or None for all.

    HF's rule: `sliding_window` set (Mistral sets it for every layer; Qwen2 and Qwen3 only
    with `use_sliding_window`, else their config clears it), and where the config lists
    `layer_types`, only the layers marked "sliding_attention" (Qwen2's layers from
    `max_window_layers` on). Query position p sees keys p - window + 1 .. p."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_id] != "sliding_attention":
        return None
    return int(window)


def model_sliding_window(config: Any) -> int | None:
    """The window of the model's windowed layers, or None when no layer has one."""
    layers = int(config.num_hidden_layers)
    windows = {layer_sliding_window(config, i) for i in range(layers)} - {None}
    return windows.pop() if windows else None


def _context_len(text_config: Any, override: int | None) -> int:
    derived: int | None = None
    for key in _CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    if override is not None:
        if derived is not None and override > derived:
            logger.warning(
                "context_length %d exceeds the model's %d positions; outputs past %d may "
                "be garbage",
                override,
                derived,
                derived,
            )
        return override
    if derived is None:
        logger.warning(
            "config has none of %s; assuming context length %d",
            _CONTEXT_KEYS,
            _FALLBACK_CONTEXT_LEN,
        )
        return _FALLBACK_CONTEXT_LEN
    return derived


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_token_ids(folder: str, hf_config: Any) -> list[int]:
    """Union of the config's and generation_config.json's eos ids, sorted."""
    ids = set(_as_id_list(getattr(hf_config, "eos_token_id", None)))
    text = hf_config.get_text_config()
    if text is not hf_config:
        ids.update(_as_id_list(getattr(text, "eos_token_id", None)))
    if (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
            ids.update(_as_id_list(gen.eos_token_id))
        except (OSError, ValueError) as e:
            logger.warning("Could not read %s/generation_config.json: %s", folder, e)
    return sorted(ids)
