"""Package-level names imported from their submodule on first use (PEP 562).

A package whose `__init__` re-exported its classes made every process that touched any of its
modules import all of them, torch included; the HTTP server and the detokenizer, which never
run a model, paid seconds of start-up for it. With `lazy_exports` a package keeps its short
import paths (`from attention import RadixAttention`) and pays only for what is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(module: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A `__getattr__` for the module named `module`: `where` maps each name to the module
    that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
