"""One registry shape for every pluggable part: attention, transfer and grammar backends,
samplers, radix eviction policies and prefix caches.

An entry maps a name to its target: an object, or a "module:attr" string that is imported on
first use. Listing the names (argparse choices, error messages) therefore imports nothing, and
a GPU-only or otherwise optional package is imported only when its entry is chosen. An entry
may name the package its module needs; it is looked up (not imported) before the import, so a
missing optional package fails with a message naming it rather than a ModuleNotFoundError
from deep inside the backend.

Names are listed in registration order: each registry registers its default first, which is
the order `--help` shows.

This module must stay cheap to import (`srt.server_args` uses it): standard library only.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def is_package_installed(name: str) -> bool:
    """Whether the top-level package `name` can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


def import_target(target: str) -> Any:
    """`"package.module:attr"` -> that attribute, importing the module."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'module:attr'")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str | Callable[..., Any]  # "module:attr", resolved on first use, or the factory
    requires: str | None  # the package the target needs, as imported (not as pip names it)
    hint: str  # appended to the missing-package error: how to install it, or what to use


class Registry(Generic[T]):
    """Name -> factory (usually a class) whose call builds a `T`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "attention backend": words for the error messages
        self._entries: dict[str, _Entry] = {}

    def register(
        self,
        name: str,
        target: str | Callable[..., T],
        requires: str | None = None,
        hint: str = "",
    ) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"target {target!r} is not of the form 'module:attr'")
        self._entries[name] = _Entry(target, requires, hint)

    def names(self) -> list[str]:
        """The registered names, in registration order (the default first)."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as `name`, importing its module if needed."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        if entry.requires is not None and not is_package_installed(entry.requires):
            hint = f"; {entry.hint}" if entry.hint else ""
            raise ImportError(
                f"{self.kind} {name!r} needs the {entry.requires!r} package, which is not "
                f"installed{hint}"
            )
        if isinstance(entry.target, str):
            return import_target(entry.target)
        return entry.target

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Build the entry `name`: its factory called with these arguments."""
        return self.get(name)(*args, **kwargs)
