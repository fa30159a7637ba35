"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style), shared by Qwen2 and Qwen3.

The decoder layer is parametrised by `LlamaForCausalLM`'s class hooks (`qk_norm`,
`attention_biases`), so Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before RoPE)
are small subclasses. Attention goes through `RadixAttention`. In an extend the last layer
computes only the rows that get logits past its attention (`logits_rows`: each request's last
new token, or the prompt-logprob rows); every row's K/V is still written.

Tensor parallelism (`tp`): attention is split by KV group (`head_layout`, computed once per
model; possibly uneven, e.g. 3 and 6 of SmolLM2's 9 query heads at tp=2), q/k/v and gate/up
are column-parallel, o_proj and down_proj row-parallel (one all-reduce each per layer), the
embedding and LM head split by vocabulary rows. Norms, RoPE and Qwen3's q/k norms are
replicated. `RadixAttention` and the KV pool see this rank's head counts only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from attention.radix_attention import RadixAttention
from srt.configs.model_config import layer_sliding_window
from srt.distributed import HeadLayout, TPGroup, head_layout
from srt.layers.activation import GeluTanhAndMul, SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from srt.layers.logits_processor import LogitsProcessor, logits_rows
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_settings_from_config
from srt.layers.vocab_embedding import LMHead, VocabEmbedding
from srt.layers.weight_utils import get_weight_loader

if TYPE_CHECKING:
    from srt.model_executor.cpu_decode_layer_runner import FusedDecode
    from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# (merged parameter, HF checkpoint name part, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def config_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_num_heads(config: PretrainedConfig) -> tuple[int, int]:
    """(query heads, KV heads) of the whole model."""
    num_heads = config.num_attention_heads
    return num_heads, getattr(config, "num_key_value_heads", None) or num_heads


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        activations = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
        if hidden_act not in activations:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(activations)}"
            )
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, tp=tp
        )
        # gate and up are cut by the same balanced range, which down_proj's input matches
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act_fn = activations[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPGroup,
        layout: HeadLayout,
        scaling: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
        logit_cap: float | None = None,
    ) -> None:
        """`scaling`: of the scores (default head_dim ** -0.5); `norm`: the q/k norms'
        class (Gemma's stores 1 + weight); `logit_cap`: Gemma 2's score soft-capping."""
        super().__init__()
        total_heads, total_kv_heads = config_num_heads(config)
        self.num_heads = layout.num_heads  # this rank's
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config_head_dim(config)
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias,
            layout=layout,
        )
        q_start, q_end = layout.q_heads
        self.o_proj = RowLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            tp=tp,
            input_range=(q_start * self.head_dim, q_end * self.head_dim),
        )
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scaling is None else scaling,
            self.num_kv_heads,
            layer_id,
            layer_sliding_window(config, layer_id),
            logit_cap,
        )

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.view(x.shape[0], -1, self.head_dim)).view(x.shape)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's K/V is written; with `keep`, only those rows of the output are
        computed past the attention (o_proj runs on them alone)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._norm_heads(q, self.q_norm)
            k = self._norm_heads(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)
        if keep is not None:
            out = out.index_select(0, keep)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPGroup,
        layout: HeadLayout,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, layer_id, rotary_emb, qkv_bias, o_bias, qk_norm, tp, layout
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            tp=tp,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the next layer's norm fuses the residual add.
        With `keep` (row indices) both are those rows only: past the attention every
        operation is per row, so the others need not be computed."""
        hidden_states, residual = norm_and_attend(
            self, positions, hidden_states, residual, forward_batch, keep
        )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def norm_and_attend(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    forward_batch: ForwardBatch,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How a decoder layer starts (Llama's and Gemma's): its input norm, which adds the
    previous layer's output to the residual, then attention; with `keep`, both results are
    those rows only. Returns (attention output, residual)."""
    if residual is None:
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    hidden_states = layer.self_attn(positions, hidden_states, forward_batch, keep)
    if keep is not None:
        residual = residual.index_select(0, keep)
    return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPGroup,
        layout: HeadLayout,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        head_dim = config_head_dim(config)
        base, rope_scaling, partial_rotary_factor = rope_settings_from_config(config)
        # One cos/sin cache shared by every layer.
        self.rotary_emb = get_rope(
            head_dim,
            int(head_dim * partial_rotary_factor),
            config.max_position_embeddings,
            base,
            rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, qkv_bias, o_bias, qk_norm, tp, layout)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Set by `cpu_decode_layer_runner.enable_fused_decode` (CPU, every layer qualifies).
        self.fused_decode: FusedDecode | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every new token, or with `keep` of those rows only (the
        last layer computes only them past its attention)."""
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        fused = self.fused_decode  # CPU decode batches: one compiled call per layer
        ran = None
        if fused is not None and keep is None:
            ran = fused.run(positions, hidden_states, forward_batch)
        if ran is not None:
            hidden_states, residual = ran
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                hidden_states, residual = layer(
                    positions, hidden_states, residual, forward_batch, keep if i == last else None
                )
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], forward_batch) -> float32 logits [N, vocab]`.

    The caller runs `forward_batch.attn_backend.init_forward_metadata(forward_batch)` first.
    With `tp` of size > 1 every rank of the group runs the same forward (the collectives
    pair up) and gets the same full-vocabulary logits; `head_layout` is this rank's heads.
    """

    qk_norm: ClassVar[bool] = False

    @classmethod
    def attention_biases(cls, config: PretrainedConfig) -> tuple[bool, bool]:
        """(q/k/v projection bias, o_proj bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        # A ValueError here when the heads cannot be split over the ranks.
        self.head_layout = head_layout(*config_num_heads(config), self.tp.size, self.tp.rank)
        self.model = self.make_model(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp=self.tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, self.tp)

    def make_model(self, config: PretrainedConfig) -> nn.Module:
        """The decoder (embedding .. final norm), `forward(input_ids, positions,
        forward_batch, keep)`; a family with other layers builds its own here."""
        qkv_bias, o_bias = self.attention_biases(config)
        return LlamaModel(config, qkv_bias, o_bias, self.qk_norm, self.tp, self.head_layout)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        # Only the rows that get logits are read after the last layer, so that layer computes
        # only them past its attention (a prefill's last token instead of all of them).
        rows = logits_rows(forward_batch)
        keep = rows if rows is not None and rows.numel() < input_ids.numel() else None
        hidden_states = self.model(input_ids, positions, forward_batch, keep)
        return self.logits_processor(
            hidden_states, self.lm_head, forward_batch, rows_selected=keep is not None
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (after the last norm) of the new tokens, or of rows `keep`
        only: what an embedding server pools. Replicated on every tensor-parallel rank."""
        return self.model(input_ids, positions, forward_batch, keep)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """A family's own checkpoint tensors (a mixture-of-experts model's experts): load
        `tensor` and return the parameter it went into, or None for the common path."""
        return None

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], need_lm_head: bool = True
    ) -> None:
        """Load HF-named tensors; q/k/v and gate/up go into their merged parameters.

        A bare base model's names (`layers.0...`, as sentence-transformers saves embedding
        models) load as `model.layers.0...`; such a checkpoint has no LM head, which only
        an embedding server (`need_lm_head=False`) may lack."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[str | int | None]] = {}
        for name, tensor in weights:
            if name.endswith(SKIPPED_WEIGHT_SUFFIXES):
                continue
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name
            special = self.load_special_weight(name, tensor)
            if special is not None:
                loaded.setdefault(special, set()).add(None)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # shared with the embedding, which the checkpoint also holds
            shard_id: str | int | None = None
            for merged, part, shard in STACKED_PARAMS:
                if part in name:
                    name, shard_id = name.replace(part, merged), shard
                    break
            param = params.get(name)
            if param is None:
                logger.warning("skipping checkpoint tensor %s: no such parameter", name)
                continue
            loader = get_weight_loader(param)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.setdefault(name, set()).add(shard_id)
        missing = [name for name in params if name not in loaded]
        if not need_lm_head:
            missing = [name for name in missing if not name.startswith("lm_head.")]
        for name, shards in loaded.items():
            if None not in shards:  # loaded shard by shard: every shard must be there
                needed = {s for merged, _, s in STACKED_PARAMS if merged in name}
                missing += [f"{name}[{s}]" for s in sorted(needed - shards, key=str)]
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {missing}")
