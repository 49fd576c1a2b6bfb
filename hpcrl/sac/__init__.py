"""Data-parallel FastSAC (holosoma semantics, its known flaws fixed): ``train(SACConfig)`` per rank.

The names below load on first use: ``python -m hpcrl.sac`` parses its flags and refuses a bad
configuration or a run dir it must not touch before torch is imported (seconds, not the 20-30 s torch
takes to import on a loaded node)."""

from __future__ import annotations

from hpcrl.core.lazy_names import lazy_names

__all__ = ["FastSAC", "UpdateNoise", "SACConfig", "PRESETS", "preset", "ConfigError", "plan", "train"]
__getattr__, __dir__ = lazy_names(__name__, {"FastSAC": "agent", "UpdateNoise": "agent", "SACConfig": "config",
                                             "PRESETS": "config", "preset": "config", "ConfigError": "config",
                                             "plan": "run", "train": "run"})

