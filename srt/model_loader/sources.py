"""Where a model's files come from, and its tokenizer. No torch here: the HTTP server's main
process and the detokenizer resolve paths and load tokenizers, and never run a model.

``resolve_model_path``: None -> the default GGUF; a ``.gguf`` -> its converted HF folder
(``gguf_convert``); an HF folder -> itself; ``Org/Name`` -> its snapshot in the local Hugging
Face cache (``hf_cache``). No model hub is ever contacted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    source = _tokenizer_source(path, tokenizer_path, cache_dir)
    direct = _tokenizers_backend_for(Path(source))
    if direct is not None:
        return direct.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def _tokenizer_source(path: str, tokenizer_path: str | None, cache_dir: str | None) -> str:
    """Where the tokenizer is read from: `tokenizer_path` or else `path`, a GGUF file by its
    converted folder and a model id by its snapshot in the local Hugging Face cache."""
    source = tokenizer_path or path
    if source.endswith(".gguf") and Path(source).is_file():
        return str(convert_gguf(source, cache_dir))
    if looks_like_repo_id(source) and (snapshot := cached_snapshot(source)) is not None:
        return str(snapshot)
    return source


def get_decoding_tokenizer(
    path: str, tokenizer_path: str | None = None, cache_dir: str | None = None
) -> Any:
    """What the detokenizer decodes with: where `get_tokenizer` would give `TokenizersBackend`
    over a `tokenizer.json` it uses as it is, the `tokenizers` library's tokenizer of that file
    alone (`BackendDecoder`: it decodes the same, and importing transformers was most of the
    detokenizer's start); elsewhere `get_tokenizer`'s tokenizer."""
    decoder = BackendDecoder.for_folder(Path(_tokenizer_source(path, tokenizer_path, cache_dir)))
    return decoder if decoder is not None else get_tokenizer(path, tokenizer_path, cache_dir)


# The tokens `TokenizersBackend` adds to its backend when the backend lacks them as added
# tokens: those of tokenizer_config.json's `added_tokens_decoder`, its named special tokens,
# and its extra special tokens.
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
_EXTRA_SPECIAL_TOKENS = ("additional_special_tokens", "extra_special_tokens")


class BackendDecoder:
    """`decode` and `added_tokens_decoder` of a `tokenizers.Tokenizer`, as `TokenizersBackend`
    gives them: its `decode` is the backend's, followed by a clean-up of spaces that it skips
    for BPE models, and of what decoding reads it changes only the added tokens (it adds those
    the backend lacks; the rest of its changes are to encoding). So where the folder is one
    `get_tokenizer` reads as `TokenizersBackend`, its model is BPE (or the clean-up is off) and
    no token would be added, decoding with the backend alone is the same
    (`tests/srt/test_model_sources.py` checks it)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.added_tokens_decoder = backend.get_added_tokens_decoder()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def for_folder(cls, folder: Path) -> BackendDecoder | None:
        """The folder's decoder, or None where `TokenizersBackend` would decode otherwise."""
        if not _reads_as_tokenizers_backend(folder):
            return None
        from tokenizers import Tokenizer

        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - unreadable here: the full path says why
            return None
        bpe = type(backend.model).__name__ == "BPE"
        if not bpe and config.get("clean_up_tokenization_spaces", False):
            return None
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        if any(token not in added for token in _config_tokens(config)):
            return None
        return cls(backend)


def _config_tokens(config: dict[str, Any]) -> list[str]:
    """The contents of the tokens tokenizer_config.json names (`_NAMED_SPECIAL_TOKENS`...)."""

    def content(token: Any) -> str | None:
        return token.get("content") if isinstance(token, dict) else token

    named: list[Any] = [config.get(key) for key in _NAMED_SPECIAL_TOKENS]
    named += list(config.get("added_tokens_decoder", {}).values())
    for key in _EXTRA_SPECIAL_TOKENS:
        extra = config.get(key) or []
        named += list(extra.values()) if isinstance(extra, dict) else list(extra)
    return [text for text in map(content, named) if isinstance(text, str)]


def _tokenizers_backend_for(folder: Path) -> type[PreTrainedTokenizerBase] | None:
    """`TokenizersBackend` where `AutoTokenizer` would choose exactly it, else None.

    That is when the folder's tokenizer_config.json names it (or its alias
    `PreTrainedTokenizerFast`), ships no tokenizer code of its own (`auto_map`), and the
    model type is one whose declared tokenizer class `AutoTokenizer` keeps. Reading the two
    JSON files spares `AutoTokenizer`'s import, which loads torch and every model
    configuration, in each of the three processes that hold a tokenizer (a server's start
    is mostly imports; `tests/srt/test_model_sources.py` checks both give one tokenizer).
    """
    if not _reads_as_tokenizers_backend(folder):
        return None
    from transformers import TokenizersBackend

    return TokenizersBackend


def _reads_as_tokenizers_backend(folder: Path) -> bool:
    """`_tokenizers_backend_for`'s test, read from the folder's two JSON files."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (
        tokenizer_config.get("tokenizer_class") in DIRECT_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and model_type in DIRECT_TOKENIZER_MODEL_TYPES
        and (folder / "tokenizer.json").is_file()
    )
