"""Model ids (`Org/Name`) found in a local Hugging Face cache, never downloaded.

`--model-path Qwen/Qwen3-0.6B` is how SGLang and vLLM users name a model; with the model
already in the Hugging Face cache (`huggingface-cli download Qwen/Qwen3-0.6B`, or an earlier
run of another engine), we serve it from there. Where the cache is: `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`, read at each call, as `huggingface_hub` reads
them at import. The snapshot is the one `refs/main` names (what `huggingface_hub` resolves
offline); nothing is fetched, and a miss says where we looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# A hub repo id: an organisation (or user) and a name, no path separators besides the one.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def looks_like_repo_id(model_path: str) -> bool:
    return REPO_ID.fullmatch(model_path) is not None and not Path(model_path).exists()


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of `repo_id` (with its config.json), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    path = Path(folder)
    return path if (path / "config.json").is_file() else None
