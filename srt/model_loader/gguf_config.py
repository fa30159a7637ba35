"""What transformers' GGUF reader drops, put back into the config before the model is built.

transformers' GGUF reader maps a fixed list of metadata keys per architecture and leaves
every other setting at its config class's default: one checkpoint's value, silently wrong
for the others. These put back what llama.cpp's converter writes (or, where the file is
silent, what llama.cpp itself assumes) for the architectures served here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the converter imports these; finding a converted folder needs none
    import numpy as np
    from gguf import GGUFReader, ReaderTensor
    from transformers import PretrainedConfig

    Metadata = dict[str, object]  # a GGUF's keys of its architecture, the prefix cut
    Tensors = dict[str, ReaderTensor]


def restore_config(config: PretrainedConfig, reader: GGUFReader) -> None:
    arch = reader.fields["general.architecture"].contents()
    restore = _RESTORE.get(arch)
    if restore is None:
        return
    prefix = f"{arch}."
    meta = {
        key.removeprefix(prefix): field.contents()
        for key, field in reader.fields.items()
        if key.startswith(prefix)
    }
    restore(config, meta, {tensor.name: tensor for tensor in reader.tensors})
    config.validate()


def _restore_llama(config: PretrainedConfig, meta: Metadata, tensors: Tensors) -> None:
    """Llama 3.1's RoPE scaling (3.2's and 3.3's too), which llama.cpp stores only as what
    each rotary frequency is divided by (`rope_freqs`)."""
    if "rope_freqs.weight" not in tensors:
        return
    import numpy as np

    divisors = _values(tensors["rope_freqs.weight"]).astype(np.float64)
    rotary_dim = 2 * len(divisors)
    base = config.rope_parameters["rope_theta"]
    wavelengths = 2 * np.pi * base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    config.rope_parameters = {**config.rope_parameters, **_llama3_scaling(divisors, wavelengths)}


def _llama3_scaling(divisors: np.ndarray, wavelengths: np.ndarray) -> dict[str, object]:
    """HF's `llama3` parameters that divide the frequencies of these wavelengths by
    `divisors`: by 1 below context / high_freq_factor, by `factor` above context /
    low_freq_factor, by a blend between, linear in 1 / wavelength. The blend gives the band
    only up to scale, so low_freq_factor is taken as 1, as in every Llama 3 config (and
    high_freq_factor as their 4 where the band holds under two frequencies, their context
    8192 where it holds none). Checked by recomputing the divisors: a file they do not fit
    is refused."""
    import numpy as np

    factor = float(divisors.max())
    if factor == 1.0:
        return {}
    # With low_freq_factor 1: blend = context / (high - 1) / wavelength - 1 / (high - 1).
    blend = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    band = (blend > 1e-4) & (blend < 1 - 1e-4)
    offset = -1 / 3
    if band.sum() >= 2:
        slope, offset = np.polyfit(1 / wavelengths[band], blend[band], 1)
        context = round(float(-slope / offset))
    elif band.any():
        context = round(float(np.mean((blend[band] - offset) * wavelengths[band]) / -offset))
    else:
        context = 8192
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(1 - 1 / offset), 4),
        "original_max_position_embeddings": context,
    }
    if not np.allclose(_llama3_divisors(wavelengths, scaling), divisors, rtol=1e-4):
        raise RuntimeError(
            f"the file's rope_freqs fit no Llama 3 RoPE scaling (nearest: {scaling}), so the "
            "model's positions cannot be encoded as it was trained"
        )
    return scaling


def _llama3_divisors(wavelengths: np.ndarray, scaling: dict[str, object]) -> np.ndarray:
    import numpy as np

    context, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    blend = np.clip((context / wavelengths - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - blend) / factor + blend)


def _restore_gemma(config: PretrainedConfig, meta: Metadata, tensors: Tensors) -> None:
    """Gemma 2's and 3's soft-caps (Gemma 2's attention cap would stay 50), Gemma 3's linear
    RoPE scaling of its global layers, and the score scale, which the file leaves out:
    llama.cpp takes head_dim, but hidden_size / heads in the 27B models (46 and 62 layers),
    as their configs do."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key in meta:
            setattr(config, key, meta[key])
    is_27b = config.num_hidden_layers == (46 if config.model_type == "gemma2" else 62)
    per_head = config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = per_head if is_27b else config.head_dim
    global_rope = config.rope_parameters.get("full_attention")
    if global_rope is not None and meta.get("rope.scaling.type") == "linear":
        global_rope.update(rope_type="linear", factor=meta["rope.scaling.factor"])


def _restore_phi3(config: PretrainedConfig, meta: Metadata, tensors: Tensors) -> None:
    """Phi-3's rotary width (Phi-4-mini rotates 3/4 of each head), its window (llama.cpp
    writes 0 for none), and the LongRoPE of its long-context models: factor tensors and
    the original context length."""
    head_dim = config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters)
    rope["partial_rotary_factor"] = meta.get("rope.dimension_count", head_dim) / head_dim
    config.sliding_window = meta.get("attention.sliding_window") or None
    if "rope_factors_long.weight" in tensors:
        original = meta["rope.scaling.original_context_length"]
        config.original_max_position_embeddings = original
        rope.update(
            rope_type="longrope",
            original_max_position_embeddings=original,
            long_factor=_decimals(tensors["rope_factors_long.weight"]),
            short_factor=_decimals(tensors["rope_factors_short.weight"]),
        )
    config.rope_parameters = rope


def _restore_qwen3moe(config: PretrainedConfig, meta: Metadata, tensors: Tensors) -> None:
    """The experts' width (the reader keeps Qwen3-30B-A3B's, and no other model loads)."""
    config.moe_intermediate_size = meta["expert_feed_forward_length"]


_RESTORE = {
    "llama": _restore_llama,
    "gemma2": _restore_gemma,
    "gemma3": _restore_gemma,
    "phi3": _restore_phi3,
    "qwen3moe": _restore_qwen3moe,
}


def _values(tensor: ReaderTensor) -> np.ndarray:
    from gguf import dequantize

    return dequantize(tensor.data, tensor.tensor_type)


def _decimals(tensor: ReaderTensor) -> list[float]:
    """A float32 tensor's values as the shortest decimals that round-trip, so 1.1 stays 1.1
    in config.json (the rotary math casts back to float32)."""
    return [float(str(value)) for value in _values(tensor)]
