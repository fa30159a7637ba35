"""Attention backends by name, imported lazily so GPU-only packages stay optional."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attention.base import AttentionBackend

# name -> (module, class, pip package the module needs or None). GPU backends (flashinfer)
# register here with the package they need, which is only imported when one is chosen.
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "torch_native": ("attention.torch_native_backend", "TorchNativeAttnBackend", None),
}


def available_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_attention_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Build the backend registered as `name`; kwargs go to its constructor."""
    try:
        module_name, class_name, requirement = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_attention_backends()}"
        ) from None
    if requirement is not None and importlib.util.find_spec(requirement) is None:
        raise ImportError(
            f"attention backend {name!r} needs the {requirement!r} package, which is not "
            f"installed (pip install 'radixrt[gpu]'); use --attention-backend torch_native"
        )
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(**kwargs)
