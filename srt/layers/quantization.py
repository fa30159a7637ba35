"""Weights kept quantized on CPU (`--quantization`): which layers hold them, and how.

`gguf` keeps a GGUF file's Q4_0, Q4_1 and Q8_0 tensors as they are stored; `int8` / `int4`
quantize a float checkpoint at load (`srt.kernels.quant.quantize`). The linear layers (q, k,
v, o, gate, up, down) and the LM head run through the quantized kernel
(`srt/kernels/csrc/quant_linear.c`); an embedding table tied to a quantized LM head looks its
rows up in the head's panels, so the table is held once, quantized.

Loading: `srt.model_loader.gguf_quant` hands each GGUF-backed checkpoint tensor to the model's
`load_weights` as usual (the float values, exact) with its blocks attached
(`QUANT_BLOCKS_ATTR`); the loaders of the layers that can run quantized cut the blocks as
they cut the tensor (this rank's rows, or its blocks of columns for a row-parallel layer) and
record them per shard (`record_blocks`), every other loader just copies the floats.
`quantize_model` then stacks each layer's recorded shards, packs them, and replaces the dense parameter with a meta
tensor of the same shape and dtype: the float copy is gone, and any path that would still
read it fails loudly instead of computing with stale values. A layer whose shards are not
all quantized alike (a Q4_K_M file mixes types), or whose cut does not fall on blocks of 32,
keeps its float weight.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from srt.kernels.quant import BITS, QK, QuantBlocks, QuantLinearKernel, quant_linear_kernel
from srt.kernels.quant import quantize as quantize_blocks
from srt.layers.cpu_packed import panels_onto_huge_pages

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
# The attribute of a checkpoint tensor that carries its GGUF blocks (`gguf_quant`).
QUANT_BLOCKS_ATTR = "gguf_blocks"


def attached_blocks(loaded_weight: torch.Tensor) -> QuantBlocks | None:
    """The GGUF blocks a checkpoint tensor carries, if any."""
    return getattr(loaded_weight, QUANT_BLOCKS_ATTR, None)


def record_blocks(
    module: nn.Module,
    shard_id: object,
    offset: int,
    loaded_weight: torch.Tensor,
    cut: Callable[[QuantBlocks], QuantBlocks],
) -> None:
    """Keep this rank's part of the blocks `loaded_weight` carries (`cut`: the same cut the
    loader made of the tensor) as shard `shard_id` (None: the whole weight) of `module`'s
    weight, at row `offset`, for `quantize_model`. A float shard, or a cut that splits a block
    of 32, is kept as None: the layer stays float."""
    blocks = attached_blocks(loaded_weight)
    if blocks is None and "_quant_parts" not in module.__dict__:
        return  # a float layer so far
    if blocks is not None:
        try:
            blocks = cut(blocks)
        except ValueError as e:  # this rank's input columns split a block
            logger.info("%s stays float: %s", type(module).__name__, e)
            blocks = None
    module.__dict__.setdefault("_quant_parts", {})[shard_id] = (offset, blocks)


def recorded_blocks(module: nn.Module) -> QuantBlocks | None:
    """The blocks `record_blocks` kept for `module`'s whole weight (this rank's rows), or
    None where a shard is float or missing or the shards' types differ."""
    parts = module.__dict__.get("_quant_parts")
    if not parts or any(blocks is None for _, blocks in parts.values()):
        return None
    ordered = [blocks for _, blocks in sorted(parts.values(), key=lambda part: part[0])]
    if sum(blocks.shape[0] for blocks in ordered) != module.weight.shape[0]:
        return None  # a shard never came
    try:
        return QuantBlocks.cat(ordered)
    except ValueError as e:  # a Q4_K_M file mixes types
        logger.info("%s stays float: %s", type(module).__name__, e)
        return None


@dataclass(eq=False)
class QuantizedWeight:
    """One layer's weight kept quantized: the kernel's panels of an `[N, K]` weight of
    `kind` (a GGUF type, or int8 / int4), and its bias in float32 (the kernel's)."""

    kind: str
    shape: tuple[int, int]
    panels: torch.Tensor
    kernel: QuantLinearKernel
    bias: torch.Tensor | None = None

    @classmethod
    def pack(
        cls, blocks: QuantBlocks, kernel: QuantLinearKernel, bias: torch.Tensor | None
    ) -> QuantizedWeight:
        float_bias = None if bias is None else bias.detach().float().contiguous()
        return cls(blocks.kind, blocks.shape, kernel.pack(blocks), kernel, float_bias)

    @property
    def bits(self) -> int:
        return BITS[self.kind]

    def linear(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x @ W.T (+ bias) for a float32 or bfloat16 CPU input (out in x's dtype)."""
        bias = self.bias if add_bias else None
        return self.kernel(x, self.panels, self.bits, self.shape[0], bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized (float32): an embedding lookup."""
        return self.kernel.gather_rows(self.panels, self.bits, self.shape[1], ids)


def resolve_quantization(choice: str, is_gguf: bool, device: str) -> str:
    """What `--quantization` means for this model: `auto` keeps a GGUF file's quantized
    tensors on CPU (`gguf`) and quantizes nothing otherwise (`none`). Quantized weights run
    on CPU only."""
    if choice not in QUANTIZATIONS:
        raise ValueError(f"--quantization {choice!r}: choose one of {QUANTIZATIONS}")
    if choice == "auto":
        return "gguf" if is_gguf and device == "cpu" and quant_linear_kernel() else "none"
    if choice != "none" and device != "cpu":
        raise ValueError(f"--quantization {choice} runs on CPU only (device {device})")
    if choice == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model file")
    if choice != "none" and quant_linear_kernel() is None:
        raise ValueError(f"--quantization {choice}: the quantized CPU kernel could not be built")
    return choice


def _meta_like(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), False)


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the float weights of `model`'s linear layers and LM head by quantized ones:
    `gguf` from the blocks their loaders recorded, `int8` / `int4` by quantizing the float
    weights. Returns how many weights were quantized."""
    from srt.layers.linear import LinearBase
    from srt.layers.vocab_embedding import LMHead, VocabEmbedding

    kernel = quant_linear_kernel()
    if method == "none" or kernel is None:
        return 0
    kinds: Counter[str] = Counter()
    tied_embeddings: dict[int, nn.Module] = {}  # the float table's id -> its LM head
    for module in model.modules():
        if not isinstance(module, (LinearBase, LMHead)):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % QK:
            continue
        if method == "gguf":
            owner = module
            if isinstance(module, LMHead) and module.tied:
                owner = _embedding_of(model, weight)  # same rows: `LMHead.tie_to`
            blocks = None if owner is None else recorded_blocks(owner)
            if blocks is None:
                continue
        else:
            blocks = quantize_blocks(weight.detach(), method)
        quantized = QuantizedWeight.pack(blocks, kernel, module.bias)
        module.quant = quantized
        kinds[blocks.kind] += 1
        module.weight = _meta_like(weight)
        if isinstance(module, LMHead) and module.tied:
            tied_embeddings[id(weight)] = module
    for module in model.modules():
        if isinstance(module, VocabEmbedding) and id(module.weight) in tied_embeddings:
            head = tied_embeddings[id(module.weight)]
            module.quant, module.weight = head.quant, head.weight  # still one (meta) table
        module.__dict__.pop("_quant_parts", None)
    if kinds:
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        logger.info("Quantized weights: %s (%s)", summary, method)
    # Every decode step streams them all, as it does the float panels (the reason is there).
    held = {id(m.quant): m.quant for m in model.modules() if getattr(m, "quant", None)}
    panels_onto_huge_pages(list(held.values()))
    return sum(kinds.values())


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by how they are held: `quantized` (the kernel's panels),
    and each float dtype of the parameters still held (a tied table counted once)."""
    sizes: Counter[str] = Counter()
    seen: set[int] = set()
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None and id(quant) not in seen:
            seen.add(id(quant))
            sizes["quantized"] += quant.panels.nbytes
    for param in model.parameters():
        if param.device.type != "meta":
            sizes[str(param.dtype).removeprefix("torch.")] += param.numel() * param.element_size()
    return dict(sizes)


def _embedding_of(model: nn.Module, weight: nn.Parameter) -> nn.Module | None:
    from srt.layers.vocab_embedding import VocabEmbedding

    for module in model.modules():
        if isinstance(module, VocabEmbedding) and module.weight is weight:
            return module
    return None
