"""Qwen2: the Llama decoder with a bias on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from transformers import PretrainedConfig

from srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False
