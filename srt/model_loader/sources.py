"""Where a model's files come from, and its tokenizer. No torch here: the HTTP server's main
process and the detokenizer resolve paths and load tokenizers, and never run a model.

``resolve_model_path``: None -> the default GGUF; a ``.gguf`` -> its converted HF folder
(``gguf_convert``); an HF folder -> itself; ``Org/Name`` -> its snapshot in the local Hugging
Face cache (``hf_cache``). No model hub is ever contacted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from srt.model_loader.default_model import ModelNotFoundError, find_default_gguf
from srt.model_loader.gguf_convert import convert_gguf
from srt.model_loader.hf_cache import cached_snapshot, hub_cache_dir, looks_like_repo_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The class names transformers writes for a tokenizer run by the `tokenizers` library, and the
# model types served here for which `AutoTokenizer` keeps that declared class. For others it
# substitutes its own (Qwen2's `Qwen2Tokenizer`; the types of its
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; mistral-common's backend for some Mistral
# folders), so those go through it. `tests/srt/test_model_sources.py` checks both lists.
DIRECT_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
DIRECT_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3"})


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> str:
    """A local HF-format folder for ``model_path``: a folder, a GGUF file (converted once),
    or a model id (`Org/Name`) already in the local Hugging Face cache (`hf_cache.py`)."""
    if model_path is None:
        return str(convert_gguf(find_default_gguf(), cache_dir))
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path, cache_dir))
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(convert_gguf(ggufs[0], cache_dir))
        hint = f" It holds {len(ggufs)} .gguf files; pass one of them." if ggufs else ""
        raise ModelNotFoundError(f"{path} is a folder without config.json.{hint}")
    if looks_like_repo_id(model_path):
        snapshot = cached_snapshot(model_path)
        if snapshot is not None:
            return str(snapshot)
        raise ModelNotFoundError(
            f"Model {model_path!r} is not in the local Hugging Face cache ({hub_cache_dir()}; "
            "set HF_HOME or HF_HUB_CACHE to look elsewhere), and RadixRT never downloads from "
            f"a model hub: run `huggingface-cli download {model_path}` first, or pass a folder."
        )
    raise ModelNotFoundError(
        f"Model path {model_path!r} is neither a local HF folder (with config.json), a .gguf "
        "file, nor a model id in the local Hugging Face cache. RadixRT never downloads from a "
        "model hub: download the model first (e.g. `huggingface-cli download <repo> "
        "--local-dir <dir>`) and pass the folder."
    )


def get_tokenizer(
    path: str, tokenizer_path: str | None = None, cache_dir: str | None = None
) -> PreTrainedTokenizerBase:
    """The local tokenizer of ``tokenizer_path`` (a folder, a .gguf, or a model id in the
    local Hugging Face cache) or else of ``path``."""
    source = tokenizer_path or path
    if source.endswith(".gguf") and Path(source).is_file():
        source = str(convert_gguf(source, cache_dir))
    elif looks_like_repo_id(source) and (snapshot := cached_snapshot(source)) is not None:
        source = str(snapshot)
    direct = _tokenizers_backend_for(Path(source))
    if direct is not None:
        return direct.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def _tokenizers_backend_for(folder: Path) -> type[PreTrainedTokenizerBase] | None:
    """`TokenizersBackend` where `AutoTokenizer` would choose exactly it, else None.

    That is when the folder's tokenizer_config.json names it (or its alias
    `PreTrainedTokenizerFast`), ships no tokenizer code of its own (`auto_map`), and the
    model type is one whose declared tokenizer class `AutoTokenizer` keeps. Reading the two
    JSON files spares `AutoTokenizer`'s import, which loads torch and every model
    configuration, in each of the three processes that hold a tokenizer (a server's start
    is mostly imports; `tests/srt/test_model_sources.py` checks both give one tokenizer).
    """
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    if (
        tokenizer_config.get("tokenizer_class") not in DIRECT_TOKENIZER_CLASSES
        or "auto_map" in tokenizer_config
        or model_type not in DIRECT_TOKENIZER_MODEL_TYPES
        or not (folder / "tokenizer.json").is_file()
    ):
        return None
    from transformers import TokenizersBackend

    return TokenizersBackend
