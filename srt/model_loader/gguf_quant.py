"""A GGUF file's quantized tensors, matched to the checkpoint tensors of its converted folder
(`--quantization gguf`).

The converted folder (`gguf_convert`) holds every weight dequantized to float32, under HF
names, with llama.cpp's reordering of the q and k rows undone. `attach_gguf_blocks` walks
those tensors and, for each one whose GGUF source is of a type the quantized kernel runs
(Q4_0, Q4_1, Q8_0), attaches the source's blocks (`srt.layers.quantization`), rows in the
same order. A match is kept only when the blocks dequantize to exactly the tensor's values,
so a name or row order guessed wrong leaves that weight float instead of wrong. The matched
blocks are kept in the folder (`BLOCKS_FILE`), so only the first load reads the GGUF file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from srt.kernels.quant import GGUF_BLOCK_BYTES, QK, from_gguf
from srt.layers.quantization import QUANT_BLOCKS_ATTR
from srt.model_loader.gguf_convert import MARKER_FILE

logger = logging.getLogger(__name__)

# The matched blocks, kept in the converted folder by the first load (`attach_gguf_blocks`),
# in a subfolder: the loader reads every *.safetensors of the folder itself as weights.
BLOCKS_FILE = "radixrt_gguf_blocks/blocks.safetensors"


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a converted folder was made from, or None for any other folder."""
    marker = Path(folder) / MARKER_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["source"])


class GGUFBlocks:
    """The quantized tensors of one GGUF file, by the HF name of the weight they hold."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.reader = gguf.GGUFReader(path)
        arch_field = self.reader.fields["general.architecture"]
        arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode()
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
        blocks = self._int_field(f"{arch_name}.block_count")
        self.name_map = gguf.get_tensor_name_map(arch, blocks)
        self.heads = {
            self._int_field(f"{arch_name}.attention.head_count"),
            self._int_field(f"{arch_name}.attention.head_count_kv"),
        } - {0}
        self.tensors = {t.name: t for t in self.reader.tensors}

    def _int_field(self, key: str) -> int:
        field = self.reader.fields.get(key)
        return 0 if field is None else int(field.parts[field.data[0]][0])

    def raw_for(self, hf_name: str, dense: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(type, raw blocks [N, block bytes * K / 32]) of `hf_name`'s GGUF tensor, rows in
        `dense`'s order, when they dequantize to exactly `dense`; else None."""
        if dense.dim() != 2 or not hf_name.endswith(".weight"):
            return None
        base = self.name_map.get_name(hf_name.removesuffix(".weight"))
        tensor = self.tensors.get(f"{base}.weight") if base is not None else None
        if tensor is None or tensor.tensor_type.name not in GGUF_BLOCK_BYTES:
            return None
        n, k = dense.shape
        if k % QK or tuple(int(s) for s in tensor.shape) != (k, n):
            return None
        kind = tensor.tensor_type.name
        raw = torch.from_numpy(tensor.data.view("uint8").reshape(n, -1).copy())
        blocks = from_gguf(kind, raw, n, k)
        expected = dense.float()
        for order in self._row_orders(n):
            candidate = blocks if order is None else blocks.rows(order)
            if torch.equal(candidate.dequantize(), expected):
                return kind, raw if order is None else raw[order].contiguous()
        logger.info("%s stays float: its %s blocks do not match", hf_name, kind)
        return None

    def _row_orders(self, n: int) -> Iterator[torch.Tensor | None]:
        """The file's row order, then llama.cpp's q/k reordering undone for each head count
        (as transformers undoes it: each head's rows, read as [dim][2], are taken as [2][dim])."""
        yield None
        for heads in sorted(self.heads):
            if n % (2 * heads) == 0:
                yield torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def attach_gguf_blocks(
    weights: Iterator[tuple[str, torch.Tensor]], gguf_path: Path, folder: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (the converted folder's tensors), each of the GGUF file's quantized weights
    carrying its blocks as the `QUANT_BLOCKS_ATTR` attribute.

    The first load matches them in the file (parsing its metadata, the vocabulary included,
    takes seconds) and keeps the matched blocks, in the folder's row order, in
    `BLOCKS_FILE` beside the weights; later loads read that file."""
    kept = folder / BLOCKS_FILE
    if kept.is_file():
        yield from _attach_kept(weights, kept)
        return
    source = GGUFBlocks(gguf_path)
    matched: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, tensor in weights:
        found = source.raw_for(name, tensor)
        if found is not None:
            kinds[name], matched[name] = found
            _attach(tensor, name, kinds[name], matched[name])
        yield name, tensor
    logger.info("GGUF %s: %d quantized weights kept as stored", gguf_path.name, len(matched))
    _keep(kept, matched, kinds)


def _attach(tensor: torch.Tensor, name: str, kind: str, raw: torch.Tensor) -> None:
    n, k = tensor.shape
    setattr(tensor, QUANT_BLOCKS_ATTR, from_gguf(kind, raw, n, k))


def _attach_kept(
    weights: Iterator[tuple[str, torch.Tensor]], kept: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(kept), framework="pt", device="cpu") as f:
        kinds = f.metadata() or {}
        for name, tensor in weights:
            if name in kinds:
                _attach(tensor, name, kinds[name], f.get_tensor(name))
            yield name, tensor


def _keep(kept: Path, matched: dict[str, torch.Tensor], kinds: dict[str, str]) -> None:
    """Write the matched blocks beside the converted weights (through a temporary file and a
    rename: a concurrent reader sees the whole file or none); a read-only folder keeps
    nothing, and the next load matches again."""
    from safetensors.torch import save_file

    tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
    try:
        kept.parent.mkdir(exist_ok=True)
        save_file(matched, str(tmp), metadata=kinds)
        os.replace(tmp, kept)
    except OSError as e:
        logger.info("GGUF blocks not kept in %s: %s", kept.parent, e)
        tmp.unlink(missing_ok=True)
