"""Tiny float32 GGUF files of the tiny HF models, laid out as llama.cpp's converter
(`convert_hf_to_gguf.py`) writes them: its architecture names and metadata keys, tensor
names from `gguf`'s own map, Llama's q/k rows permuted, Gemma's norms stored as 1 + w,
Qwen3-MoE's experts stacked per layer, Phi-3's LongRoPE factors and Llama 3's RoPE scaling
as tensors. The vocabulary is made up (letters and letter pairs), which is all a server run
on token ids needs, in the tokenizer type of each architecture's real files.

A GGUF cannot say everything a config can, and llama.cpp fills the gaps with fixed
assumptions. `FORMAT_ASSUMES` sets the tiny model to those, so a file describes its source
model exactly and HF on that model (saved beside the file) is the reference for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tests.engine.tiny_models import tiny_config

GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mistral": "llama",  # llama.cpp converts Mistral and Mixtral as Llama
    "mixtral": "llama",
    "qwen3-moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "phi3-long": "phi3",
}
# llama.cpp scales Gemma's scores by head_dim ** -0.5 (but in the 27B models); the tiny
# Gemmas' head_dim is 64.
_GEMMA_SCALE = {"query_pre_attn_scalar": 64}
FORMAT_ASSUMES: dict[str, dict[str, object]] = {
    # A Llama-arch file has no sliding window.
    "mistral": {"sliding_window": None},
    # Every layer sparse, top-k weights renormalised.
    "qwen3-moe": {"mlp_only_layers": [], "norm_topk_prob": True},
    # The converter drops Gemma 2's lm_head.
    "gemma2": {**_GEMMA_SCALE, "tie_word_embeddings": True},
    # Every sixth layer global: six layers, so that one is.
    "gemma3": {
        **_GEMMA_SCALE,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}


def save_tiny_gguf(
    arch: str,
    folder: Path,
    leave_out: tuple[str, ...] = (),
    quant: dict[str, str] | None = None,
    **overrides: object,
) -> Path:
    """Write `folder/hf` (the tiny model of `arch`, with `FORMAT_ASSUMES` and then
    `overrides` set on its config) and `folder/<arch>.gguf`, its GGUF without the tensors
    whose GGUF names end with one of `leave_out`; return the GGUF's path. `quant` stores
    matrices quantized as llama.cpp's `llama-quantize` would: GGUF name prefix -> type
    (`{"token_embd": "Q8_0", "": "Q4_1"}`: the embedding Q8_0, every other matrix Q4_1; the
    first matching prefix wins). `folder/hf` keeps the unquantized weights."""
    import gguf

    model = tiny_gguf_model(arch, **overrides)
    model.save_pretrained(folder / "hf")
    config = model.config
    path = folder / f"{arch}.gguf"
    writer = gguf.GGUFWriter(path, GGUF_ARCH[arch])
    # A model's own name, as llama.cpp writes it (transformers would read a Llama-arch file
    # named exactly "mistral" as Mistral).
    writer.add_name("Mistral Tiny" if arch == "mistral" else f"tiny {arch}")
    _add_hparams(writer, arch, config)
    _add_vocab(writer, arch, config)
    for name, tensor in _gguf_tensors(arch, model):
        if name.endswith(leave_out):
            continue
        data = np.ascontiguousarray(tensor.float().numpy())
        kind = _quant_type(name, data, quant)
        if kind is None:
            writer.add_tensor(name, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quant_type(name: str, data: np.ndarray, quant: dict[str, str] | None) -> str | None:
    """The type `quant` gives a tensor: matrices whose rows are whole blocks of 32 only."""
    if not quant or data.ndim != 2 or data.shape[1] % 32 or not name.endswith(".weight"):
        return None
    return next((kind for prefix, kind in quant.items() if name.startswith(prefix)), None)


def tiny_gguf_model(arch: str, **overrides: object) -> torch.nn.Module:
    """The random model of `arch` a tiny GGUF holds, seeded as `save_tiny_model`'s."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    for key, value in {**FORMAT_ASSUMES.get(arch, {}), **overrides}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if arch.startswith("gemma"):  # as `save_tiny_model`: random norms check the 1 + w
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
        if arch == "gemma2":
            # Tied, a random Gemma repeats its input: its scaled embedding outweighs what the
            # layers add. A smaller table lets the layers choose the next token.
            model.get_input_embeddings().weight.mul_(0.1)
    return model


def _add_hparams(writer, arch: str, config) -> None:
    """The metadata llama.cpp's converter writes for this architecture."""
    import gguf

    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    if arch != "gemma2":  # llama.cpp's Gemma 2 always uses base 10000
        writer.add_rope_freq_base(rope["rope_theta"])
    head_dim = config.to_diff_dict().get("head_dim")  # what config.json says, as llama.cpp reads
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if GGUF_ARCH[arch] == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(
            head_dim or config.hidden_size // config.num_attention_heads
        )
        if arch == "mixtral":
            writer.add_expert_count(config.num_local_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
    elif arch == "qwen3-moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    elif arch.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    elif arch.startswith("phi3"):
        _add_phi3_hparams(writer, config)


def _add_phi3_hparams(writer, config) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(config.partial_rotary_factor * head_dim))
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    # Zero is how llama.cpp writes "no window".
    writer.add_sliding_window(config.sliding_window or 0)
    scale = config.max_position_embeddings / config.original_max_position_embeddings
    if scale > 1:
        original = config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def _add_vocab(writer, arch: str, config) -> None:
    """Letters and letter pairs, SentencePiece for the archs whose models ship one, else
    byte-level BPE with a merge per pair; special ids from the config."""
    import gguf

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = letters + [a + b for a in letters for b in letters]
    tokens = pieces[: config.vocab_size]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    specials = {config.bos_token_id: "<s>", config.eos_token_id: "</s>"}
    for token_id, token in specials.items():
        tokens[token_id], types[token_id] = token, gguf.TokenType.CONTROL
    if arch in ("qwen2", "qwen3-moe"):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        vocab = set(tokens)
        pairs = [t for t in tokens if len(t) == 2 and t[0] in vocab and t[1] in vocab]
        writer.add_token_merges([f"{t[0]} {t[1]}" for t in pairs])
    else:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        tokens[0], types[0] = "<unk>", gguf.TokenType.UNKNOWN
        writer.add_unk_token_id(0)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if config.pad_token_id is not None:
        writer.add_pad_token_id(config.pad_token_id)


def _gguf_tensors(arch: str, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) in llama.cpp's layout."""
    import gguf

    config = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GGUF_ARCH[arch])
    name_map = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # ggml's RMS norm scales by w, Gemma's by 1 + w
        if GGUF_ARCH[arch] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = _permute_rotary_halves(tensor, heads)
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            base = name.removesuffix("gate_up_proj")
            yield name_map.get_name(base + "gate_proj") + ".weight", gate
            yield name_map.get_name(base + "up_proj") + ".weight", up
            continue
        if name.endswith("mlp.experts.down_proj"):
            yield name_map.get_name(name) + ".weight", tensor
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"llama.cpp has no {GGUF_ARCH[arch]} tensor for {name}")
        yield gguf_name, tensor
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"])
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"])
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_divisors(config)


def _llama3_divisors(config) -> torch.Tensor:
    """Llama 3.1's RoPE scaling as llama.cpp stores it, with no scaling keys: the number
    each rotary frequency is divided by."""
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    scaled, _ = _compute_llama3_parameters(config)
    dim = config.head_dim
    base = config.rope_parameters["rope_theta"]
    plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return plain / scaled


def _permute_rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order per head -> ggml's interleaved pairs."""
    rows = weight.shape[0] // heads
    return weight.reshape(heads, 2, rows // 2, -1).transpose(1, 2).reshape(weight.shape)
