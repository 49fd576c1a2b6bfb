"""Detached PPO: experience makers and PPO trainers as separate process groups (``python -m hpcrl.ppo``).

The names below load on first use: ``python -m hpcrl.ppo`` refuses a run dir it must not touch before
torch is imported (seconds, not the 20-30 s torch takes to import on a loaded node)."""

from __future__ import annotations

from hpcrl.core.lazy_names import lazy_names

__all__ = ["DetachedConfig", "PPOConfig", "Topology", "train"]
__getattr__, __dir__ = lazy_names(__name__, {"DetachedConfig": "config", "train": "run", "Topology": "topology",
                                             "PPOConfig": "workload"})
