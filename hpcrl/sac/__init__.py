"""Data-parallel FastSAC (holosoma semantics, its known flaws fixed): ``train(SACConfig)`` per rank.

The names below load on first use: ``python -m hpcrl.sac`` parses its flags and refuses a bad
configuration or a run dir it must not touch before torch is imported (seconds, not the 20-30 s torch
takes to import on a loaded node)."""

from __future__ import annotations

import importlib
import sys
import types

_HOME = {"FastSAC": "agent", "UpdateNoise": "agent", "SACConfig": "config", "PRESETS": "config", "preset": "config",
         "ConfigError": "config", "plan": "train", "train": "train"}

__all__ = ["FastSAC", "UpdateNoise", "SACConfig", "PRESETS", "preset", "ConfigError", "plan", "train"]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule hpcrl.sac.train binds it here; ``hpcrl.sac.train`` stays the function,
        # as when this package imported it eagerly (the module is sys.modules["hpcrl.sac.train"]).
        if name == "train" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.train":
            value = value.train
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
