"""HF `architectures` names -> model classes, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module, class). A bare base model (`Qwen3Model`: how
# sentence-transformers saves an embedding model) has no LM head; only an embedding server
# (`--is-embedding`) loads one.
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("srt.models.gemma3", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("srt.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("srt.models.gemma3", "Gemma3ForConditionalGeneration"),
    "LlamaForCausalLM": ("srt.models.llama", "LlamaForCausalLM"),
    "LlamaModel": ("srt.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("srt.models.llama", "LlamaForCausalLM"),
    "MistralModel": ("srt.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("srt.models.moe", "MixtralForCausalLM"),
    # Phi-3 / Phi-4-mini: the Llama decoder; its checkpoint's qkv_proj and gate_up_proj are
    # already merged, and its LongRoPE is a rope_scaling type.
    "Phi3ForCausalLM": ("srt.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("srt.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2Model": ("srt.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("srt.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3Model": ("srt.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("srt.models.moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first supported name in a config's `architectures` list."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"unsupported model architectures {architectures!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )
