"""A model folder's transformers config, read back from a snapshot after its first load.

`AutoConfig.from_pretrained` imports the architecture's configuration module, and through it
much of transformers and `torch.distributed.tensor`: the largest import a scheduler makes
after torch, paid at every start for a few dozen numbers. So the first load of a config.json
keeps the config's resolved attributes (the file's values, the class's defaults, the fields
transformers derives such as `layer_types` and `rope_parameters`) under the cache root, keyed
by the file's bytes and the transformers version, and later loads read them back as a
`ConfigSnapshot` without importing the configuration module
(`python -m bench.startup` measures a start).

A config is snapshotted only when every attribute it has is plain data. Configs that nest
others (multimodal checkpoints) or hold anything else load through transformers every time.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from srt import environ

logger = logging.getLogger(__name__)

# Bumped whenever what a snapshot holds changes: older snapshots are then never read.
SNAPSHOT_FORMAT = 1
# A view transformers builds over per-layer settings: not data, and no model reads it.
_NOT_SNAPSHOTTED = frozenset({"per_layer_config"})
_SCALARS = (bool, int, float, str, type(None), torch.dtype)


class ConfigSnapshot:
    """What a transformers config offers the models and `ModelConfig`: its attributes (the
    aliases of its `attribute_map` too), `get_text_config()` and `to_dict()`."""

    def __init__(self, attributes: dict[str, Any], as_dict: dict[str, Any]) -> None:
        self.__dict__.update(attributes)
        self._snapshot_dict = as_dict

    def __getattr__(self, name: str) -> Any:
        # Reached only for names not set: transformers resolves its aliases the same way.
        alias = self.__dict__.get("attribute_map", {}).get(name)
        if alias is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self, alias)

    def get_text_config(self, *args: Any, **kwargs: Any) -> ConfigSnapshot:
        return self  # only configs without nested ones are snapshotted

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._snapshot_dict)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self.__dict__.get('model_type')!r})"


def load_hf_config(folder: str, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The config of the model in `folder`: a `ConfigSnapshot` when one was kept for this
    config.json and transformers version, else transformers' own (kept for next time when it
    can be)."""
    path = _snapshot_path(Path(folder), cache_dir)
    snapshot = _read(path)
    if snapshot is not None:
        # The same file may sit in other folders; transformers records the one it read.
        for name in ("_name_or_path", "name_or_path"):
            if name in snapshot.__dict__:
                setattr(snapshot, name, str(folder))
        return snapshot
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    state = take_snapshot(config)
    if state is not None:
        _write(path, state)
    return config


def take_snapshot(config: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """`config`'s attributes and `to_dict()` as plain data, or None if it cannot be kept."""
    if config.get_text_config() is not config:
        return None
    attributes: dict[str, Any] = {}
    # Reading every attribute would log transformers' deprecation notices for old aliases.
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for name in dir(config):
            if name.startswith("__") or name in _NOT_SNAPSHOTTED:
                continue
            try:
                value = getattr(config, name)
            except Exception:  # noqa: BLE001, S112 - a property that does not apply to this config
                continue
            if callable(value) and not isinstance(value, type):
                continue
            if not _plain(value):
                return None
            attributes[name] = value
        as_dict = config.to_dict()
    finally:
        quiet.setLevel(level)
    if not _plain(as_dict):
        return None
    return attributes, as_dict


def _plain(value: Any) -> bool:
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _snapshot_path(folder: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    import transformers

    key = hashlib.sha256((folder / "config.json").read_bytes())
    key.update(f"\0{transformers.__version__}\0{SNAPSHOT_FORMAT}".encode())
    root = Path(cache_dir).expanduser() if cache_dir else environ.cache_root()
    return root / "hf-configs" / f"{key.hexdigest()[:32]}.pickle"


class _PlainUnpickler(pickle.Unpickler):
    """Reads back plain data only: a snapshot file can name no other class."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in ("set", "frozenset"):
            return getattr(builtins, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _read(path: Path) -> ConfigSnapshot | None:
    try:
        with path.open("rb") as f:
            attributes, as_dict = _PlainUnpickler(f).load()
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a damaged snapshot is read again from the folder
        logger.warning("Ignoring the config snapshot %s: %s", path, e)
        return None
    return ConfigSnapshot(attributes, as_dict)


def _write(path: Path, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Atomically, so that a server starting alongside reads a whole snapshot or none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs only the next start's time
        logger.warning("Could not keep the config snapshot %s: %s", path, e)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
