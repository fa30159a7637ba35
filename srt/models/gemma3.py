"""Gemma 2 and Gemma 3 text models (`Gemma2ForCausalLM`; `Gemma3ForCausalLM`: Gemma 3 1B,
and the text config of the larger ones saved as such), on the Llama building blocks.

What differs from Llama, as HF's `modeling_gemma2` / `modeling_gemma3` compute it:
- RMSNorm scales by `1 + weight`: `GemmaRMSNorm` adds the 1 when the weight is loaded, so the
  shared norm (and its CPU kernel) runs unchanged (float32-exact; in bfloat16 HF multiplies
  before rounding, Llama's rule rounds first: a last-bit difference);
- four norms per layer: before and after attention, before and after the MLP;
- scores scaled by `query_pre_attn_scalar ** -0.5`; Gemma 3 has q/k norms, Gemma 2
  soft-caps the scores instead (`attn_logit_softcapping`, in every attention backend);
- local layers (`layer_types` "sliding_attention": every other one in Gemma 2, 5 of every 6
  in Gemma 3) attend through the sliding window, in Gemma 3 with their own RoPE base
  (`rope_parameters` per layer type); global layers see everything;
- GeGLU MLP (`gelu_pytorch_tanh`), embeddings scaled by sqrt(hidden_size) in the weight
  dtype, tied LM head, and final logit soft-capping (cap * tanh(logits / cap)) where set.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from srt.distributed import HeadLayout, TPGroup
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.layers.vocab_embedding import VocabEmbedding
from srt.layers.weight_utils import default_weight_loader, set_weight_loader
from srt.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    config_head_dim,
    norm_and_attend,
)

if TYPE_CHECKING:
    from srt.model_executor.forward_batch import ForwardBatch


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm, x̂ * (1 + w), held as the Llama norm of weight 1 + w."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        set_weight_loader(self.weight, _load_plus_one)


def _load_plus_one(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    default_weight_loader(param, loaded_weight.float() + 1.0)


def _rope(config: PretrainedConfig, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """Gemma 3's RoPE of one layer type; Gemma 2 has one for all (a flat `rope_parameters`)."""
    params = config.rope_parameters
    if "rope_theta" not in params:
        params = params[layer_type]
    scaling = params if params.get("rope_type", "default") != "default" else None
    return get_rope(
        head_dim, head_dim, config.max_position_embeddings, float(params["rope_theta"]), scaling
    )


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        tp: TPGroup,
        layout: HeadLayout,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config,
            layer_id,
            rotary_emb,
            bool(config.attention_bias),
            bool(config.attention_bias),
            qk_norm,
            tp,
            layout,
            scaling=config.query_pre_attn_scalar**-0.5,
            norm=GemmaRMSNorm,
            logit_cap=getattr(config, "attn_logit_softcapping", None) or None,
        )
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_activation, tp=tp
        )
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (post-MLP-norm output, residual), as `LlamaDecoderLayer` does: the next
        layer's input norm (or the final norm) adds them."""
        hidden_states, residual = norm_and_attend(
            self, positions, hidden_states, residual, forward_batch, keep
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(nn.Module):
    def __init__(
        self, config: PretrainedConfig, tp: TPGroup, layout: HeadLayout, qk_norm: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.embed_scale = config.hidden_size**0.5
        head_dim = config_head_dim(config)
        ropes = {kind: _rope(config, kind, head_dim) for kind in set(config.layer_types)}
        self.local_rotary_emb = ropes.get("sliding_attention")
        self.global_rotary_emb = ropes.get("full_attention")
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, ropes[kind], tp, layout, qk_norm)
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused_decode = None  # the CPU fused decode layer does not run Gemma's

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every new token, or of rows `keep` only."""
        hidden_states = self.embed_tokens(input_ids)
        # HF scales in the weight dtype (a bfloat16 scale in a bfloat16 model).
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(
                positions, hidden_states, residual, forward_batch, keep if i == last else None
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(LlamaForCausalLM):
    """`forward(input_ids, positions, forward_batch) -> float32 logits [N, vocab]`, as
    `LlamaForCausalLM`'s (whose weight loading, row selection and pooling it keeps)."""

    qk_norm: ClassVar[bool] = True

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        return Gemma3Model(config, self.tp, self.head_layout, self.qk_norm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        logits = super().forward(input_ids, positions, forward_batch)
        cap = self.final_logit_softcapping
        if cap:
            # Monotonic: an argmax-only batch's logits keep their argmax.
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: no q/k norms; soft-capped scores; one RoPE for every layer."""

    qk_norm: ClassVar[bool] = False


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A multimodal Gemma 3 checkpoint (4B, 12B, 27B) served for text: its language model,
    built from `text_config`. The vision tower and projector are not loaded; this server
    takes text only (image parts are refused on every route)."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        text = copy.copy(config.get_text_config())
        # The LM head is the multimodal model's: its top-level config says whether it is tied.
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        super().__init__(text, tp)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], need_lm_head: bool = True
    ) -> None:
        super().load_weights(_language_model_weights(weights), need_lm_head)


# The parts of a multimodal checkpoint a text server skips.
_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION):
            continue
        if name.startswith("language_model."):  # language_model.model.layers.0...
            name = name.removeprefix("language_model.")
        elif name.startswith("model.language_model."):  # model.language_model.layers.0...
            name = "model." + name.removeprefix("model.language_model.")
        yield name, tensor
