"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

No q/k/v bias unless `config.attention_bias`; `head_dim` comes from the config and need not
equal hidden_size / num_attention_heads.
"""

from __future__ import annotations

from typing import ClassVar

from srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
