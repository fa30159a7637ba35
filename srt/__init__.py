"""RadixRT's serving runtime. `srt.Engine` is the offline API (imported lazily, so importing
a submodule never pulls in the whole server)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
