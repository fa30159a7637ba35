"""How an embedding server (`--is-embedding`) turns a prompt's hidden states into one vector.

Read from the model folder as sentence-transformers lays it out (Qwen3-Embedding, E5, GTE):
`modules.json` names the modules in order; the `Pooling` module's `config.json` picks the
method (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and a
`Normalize` module makes the vector unit length. A folder without `modules.json` pools the
last token and normalizes, as SGLang and vLLM do for decoder models. Modules this server
cannot run (a `Dense` projection, max pooling) are refused at start-up rather than skipped:
the vectors would be plausible and wrong.

`dimensions` (OpenAI's Matryoshka truncation) is allowed only where the model's `config.json`
says it was trained for it: `matryoshka_dimensions` (the sizes) or `is_matryoshka: true`
(any size up to the hidden size), vLLM's keys. No torch here: the main process reads this
to check requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("last", "mean", "cls")
# sentence-transformers' pooling flags -> our method.
_MODE_KEYS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# Module types that change nothing we compute (the transformer itself is ours).
_PASSIVE_MODULES = ("Transformer",)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    method: str  # one of METHODS
    normalize: bool
    hidden_size: int
    # Matryoshka sizes `dimensions` may take: None = any up to hidden_size, () = none.
    dimensions: tuple[int, ...] | None = ()

    def every_token(self) -> bool:
        """Whether the vector depends on every prompt position's hidden state (mean, CLS):
        such a prompt is computed whole, never from a cached prefix."""
        return self.method != "last"

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if dimensions is None:
            return None
        if self.dimensions is not None and dimensions not in self.dimensions:
            if not self.dimensions:
                return (
                    "`dimensions` is not supported: this model was not trained for Matryoshka "
                    "truncation (its config.json sets neither `matryoshka_dimensions` nor "
                    "`is_matryoshka`)."
                )
            sizes = ", ".join(map(str, self.dimensions))
            return f"`dimensions` must be one of the model's Matryoshka sizes: {sizes}."
        if not 1 <= dimensions <= self.hidden_size:
            return f"`dimensions` must be in [1, {self.hidden_size}], got {dimensions}."
        return None


def read_pooling_config(folder: str | Path, hf_config: dict[str, Any]) -> PoolingConfig:
    """The folder's pooling, from sentence-transformers' files if present. `hf_config`: its
    `config.json` as a dict. Raises ValueError for modules this server cannot run."""
    folder = Path(folder)
    text_config = hf_config.get("text_config") or hf_config
    hidden_size = int(text_config["hidden_size"])
    sizes = hf_config.get("matryoshka_dimensions")
    if sizes:
        dimensions: tuple[int, ...] | None = tuple(int(d) for d in sizes)
    elif hf_config.get("is_matryoshka"):
        dimensions = None
    else:
        dimensions = ()
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig("last", True, hidden_size, dimensions)
    method, normalize = None, False
    for module in json.loads(modules_file.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            method = _pooling_method(folder / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind not in _PASSIVE_MODULES:
            raise ValueError(
                f"{modules_file}: the sentence-transformers module {kind!r} is not supported "
                "(supported: Transformer, Pooling, Normalize)"
            )
    if method is None:
        raise ValueError(f"{modules_file} names no Pooling module")
    return PoolingConfig(method, normalize, hidden_size, dimensions)


def _pooling_method(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    chosen = [ours for key, ours in _MODE_KEYS.items() if config.get(key)]
    unsupported = [key for key in _UNSUPPORTED_MODES if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{config_file}: exactly one of {', '.join(_MODE_KEYS)} must be set "
            f"(found {', '.join(chosen + unsupported) or 'none'})"
        )
    return chosen[0]
