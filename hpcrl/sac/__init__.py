"""Data-parallel FastSAC (holosoma semantics, its known flaws fixed): ``train(SACConfig)`` per rank."""

from .agent import FastSAC, UpdateNoise
from .config import PRESETS, SACConfig, preset
from .train import ConfigError, plan, train

__all__ = ["FastSAC", "UpdateNoise", "SACConfig", "PRESETS", "preset", "ConfigError", "plan", "train"]
