"""A package's public names loaded on first use (PEP 562), so that an entry point can refuse bad flags or
a run dir it must not touch before torch is imported (seconds, not the 20-30 s torch takes on a loaded node)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose name N lives in submodule ``homes[N]``."""
    namespace = importlib.import_module(package).__dict__

    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{homes[name]}", package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return getattr_, dir_
