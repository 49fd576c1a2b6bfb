"""Detached PPO: experience makers and PPO trainers as separate process groups (``python -m hpcrl.ppo``).

The names below load on first use: ``python -m hpcrl.ppo`` refuses a run dir it must not touch before
torch is imported (seconds, not the 20-30 s torch takes to import on a loaded node)."""

from __future__ import annotations

import importlib

_HOME = {"DetachedConfig": "config", "train": "run", "Topology": "topology", "PPOConfig": "workload"}

__all__ = ["DetachedConfig", "PPOConfig", "Topology", "train"]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
