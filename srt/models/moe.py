"""Mixture-of-experts decoders: Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral
(`MixtralForCausalLM`), the Qwen3 and Llama decoders with a `SparseMoE`
(`srt/layers/moe.py`) as the MLP of their sparse layers.

- Qwen3-MoE: layer i is sparse unless listed in `mlp_only_layers`, and when
  (i + 1) % `decoder_sparse_step` == 0; experts of `moe_intermediate_size`; top-k weights
  renormalised when `norm_topk_prob`.
- Mixtral: every layer sparse, experts of `intermediate_size`, always renormalised; its
  checkpoint's `block_sparse_moe` is our `mlp`, and its expert tensors `w1`, `w3`, `w2` are
  gate, up and down.
Experts load from HF's per-expert tensors (`experts.{e}.gate_proj.weight` ...); a checkpoint
missing any of them is refused, as a missing dense weight is.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from srt.layers.moe import DOWN, GATE, UP, SparseMoE
from srt.models.llama import LlamaForCausalLM
from srt.models.qwen3 import Qwen3ForCausalLM

# layer, expert and part of an HF per-expert tensor
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PARTS = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}


class _SparseDecoder(ABC):
    """What both families add to their dense decoder: sparse layers and expert loading."""

    renormalize_always: ClassVar[bool] = False

    @abstractmethod
    def sparse_layer(self, config: PretrainedConfig, layer_id: int) -> bool:
        """Whether layer `layer_id`'s MLP is a mixture of experts."""

    @abstractmethod
    def expert_size(self, config: PretrainedConfig) -> int:
        """One expert's intermediate size."""

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        model = super().make_model(config)  # type: ignore[misc]
        renormalize = self.renormalize_always or bool(getattr(config, "norm_topk_prob", False))
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        for i, layer in enumerate(model.layers):
            if self.sparse_layer(config, i):
                layer.mlp = SparseMoE(
                    config.hidden_size,
                    self.expert_size(config),
                    num_experts,
                    config.num_experts_per_tok,
                    renormalize,
                    self.tp,  # type: ignore[attr-defined]
                )
        return model

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        match = _EXPERT.match(name)
        if match is None:
            if ".mlp.gate." in name:  # the router, replicated
                moe = self.model.layers[int(name.split(".")[2])].mlp  # type: ignore[attr-defined]
                with torch.no_grad():
                    moe.gate.weight.copy_(tensor)
                return name
            return None
        layer, expert, part = int(match[1]), int(match[2]), _PARTS[match[3]]
        moe = self.model.layers[layer].mlp  # type: ignore[attr-defined]
        moe.load_expert(expert, part, tensor)
        self._experts_loaded.add((layer, expert, part))
        return f"model.layers.{layer}.mlp.{'w2' if part == DOWN else 'w13'}"

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], need_lm_head: bool = True
    ) -> None:
        self._experts_loaded: set[tuple[int, int, str]] = set()
        super().load_weights(weights, need_lm_head)  # type: ignore[misc]
        wanted = {
            (i, e, part)
            for i, layer in enumerate(self.model.layers)  # type: ignore[attr-defined]
            if isinstance(layer.mlp, SparseMoE)
            for e in range(layer.mlp.num_experts)
            for part in (GATE, UP, DOWN)
        }
        missing = sorted(wanted - self._experts_loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing expert weights (layer, expert, part): {missing[:8]}"
            )


class Qwen3MoeForCausalLM(_SparseDecoder, Qwen3ForCausalLM):
    def sparse_layer(self, config: PretrainedConfig, layer_id: int) -> bool:
        return (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0
        )

    def expert_size(self, config: PretrainedConfig) -> int:
        return config.moe_intermediate_size


class MixtralForCausalLM(_SparseDecoder, LlamaForCausalLM):
    renormalize_always = True

    def sparse_layer(self, config: PretrainedConfig, layer_id: int) -> bool:
        return True

    def expert_size(self, config: PretrainedConfig) -> int:
        return config.intermediate_size
