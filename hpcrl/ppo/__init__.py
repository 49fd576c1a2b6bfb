"""Detached PPO: experience makers and PPO trainers as separate process groups (``python -m hpcrl.ppo``)."""

from .config import DetachedConfig
from .run import train
from .topology import Topology
from .workload import PPOConfig

__all__ = ["DetachedConfig", "PPOConfig", "Topology", "train"]
