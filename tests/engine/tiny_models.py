"""Tiny random HF models of each supported architecture, saved to a folder for our loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB = 512
DEFAULT_MODEL_VOCAB = 49152  # the default model's tokenizer


def tiny_config(arch: str, num_kv_heads: int = 2, vocab: int = VOCAB, sliding_window: int = 8):
    """A 2-layer config of `arch` with 4 query heads over `num_kv_heads` KV heads.

    `mistral` attends through a window of `sliding_window` positions in both layers;
    `qwen2-window` only in its second (`max_window_layers` 1), as HF's Qwen2 mixes them."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 1024,
        # Wide weights give well-separated logits, so greedy ties are rare.
        "initializer_range": 0.3,
        "eos_token_id": vocab - 1,
        "bos_token_id": 1,
        "dtype": "float32",
    }
    if arch == "llama":
        return LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=True,
        )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    # Head dim 64, which the CPU attention kernels are built for (16 falls back to torch).
    wide = {**common, "hidden_size": 256, "intermediate_size": 256}
    if arch == "mistral":
        return MistralConfig(**wide, sliding_window=sliding_window, tie_word_embeddings=False)
    if arch in ("phi3", "phi3-long"):
        from transformers import Phi3Config

        # LongRoPE over 12 of the 16 dims (Phi-4-mini's partial rotary); "phi3-long" crosses
        # its original context (48) within a test's generation, "phi3" stays below 128.
        return Phi3Config(
            **common,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=48 if arch == "phi3-long" else 128,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
            },
            pad_token_id=0,
            tie_word_embeddings=False,
        )
    if arch == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        # Layer 0 dense (mlp_only_layers), layer 1 sparse: 4 experts, top 2, not renormalised.
        return Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        )
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        # One local layer (window, base 10000) and one global (base 1e6, linear scaling); a
        # score scale unlike head_dim ** -0.5, and final logit soft-capping.
        return Gemma3TextConfig(
            **{**wide, "hidden_size": 64, "intermediate_size": 128},
            head_dim=64,
            query_pre_attn_scalar=48,
            sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            },
            final_logit_softcapping=30.0,
            # Untied: a tied random model's scaled embeddings make it repeat its input.
            tie_word_embeddings=False,
            architectures=["Gemma3ForCausalLM"],
        )
    if arch == "gemma2":
        from transformers import Gemma2Config

        # A local and a global layer, scores soft-capped at 5 (they bite at this scale).
        return Gemma2Config(
            **{**wide, "hidden_size": 64, "intermediate_size": 128},
            head_dim=64,
            query_pre_attn_scalar=48,
            sliding_window=sliding_window,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
            architectures=["Gemma2ForCausalLM"],
        )
    if arch == "qwen2-window":
        return Qwen2Config(
            **wide,
            use_sliding_window=True,
            sliding_window=sliding_window,
            max_window_layers=1,
            tie_word_embeddings=False,
        )
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(arch)


def save_tiny_model(
    arch: str, folder: Path, seed: int = 0, num_kv_heads: int = 2, vocab: int = VOCAB
) -> Path:
    """Build a random HF model of `arch` and save it as an HF folder (no tokenizer; with
    `vocab` the default model's, a server can take that model's with --tokenizer-path)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, num_kv_heads=num_kv_heads, vocab=vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ("gemma2", "gemma3"):
        # HF starts Gemma's norm weights at 0 (a scale of 1); random ones check the 1 + w.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def save_tiny_gemma3_multimodal(folder: Path) -> Path:
    """The tiny Gemma 3 language model inside a multimodal Gemma 3 checkpoint
    (`Gemma3ForConditionalGeneration`, as the 4B-27B ship) with a one-layer vision tower."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    text = tiny_config("gemma3")
    # As in the released checkpoints (HF's multimodal class would not apply it either).
    text.final_logit_softcapping = None
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def save_tiny_model_with_tokenizer(folder: Path, tokenizer_from: str) -> Path:
    """A tiny random Llama with the vocabulary of the model at `tokenizer_from` and a copy
    of its tokenizer files: a server of it takes text, and clients that load the tokenizer
    of the folder the server names find one."""
    save_tiny_model("llama", folder, vocab=DEFAULT_MODEL_VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, folder / name)
    return folder


def save_tiny_embedding_model(
    folder: Path,
    tokenizer_from: str,
    pooling: str = "lasttoken",
    normalize: bool = True,
    matryoshka_dimensions: list[int] | None = None,
) -> Path:
    """A tiny random Qwen3 embedding model laid out as Qwen3-Embedding is: the bare base
    model (no LM head), the tokenizer of `tokenizer_from`, and sentence-transformers'
    module files (`pooling`: lasttoken, mean or cls; a Normalize module if `normalize`)."""
    from transformers import AutoModel

    torch.manual_seed(0)
    config = tiny_config("qwen3", vocab=DEFAULT_MODEL_VOCAB)
    if matryoshka_dimensions is not None:
        config.matryoshka_dimensions = matryoshka_dimensions
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, folder / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    chosen = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[pooling]
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    pooling_config = {f"pooling_mode_{m}": m == chosen for m in modes}
    pooling_config.update(word_embedding_dimension=config.hidden_size, include_prompt=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 1024, "do_lower_case": False})
    )
    return folder
