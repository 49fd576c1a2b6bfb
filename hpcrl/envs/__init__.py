"""Batched environments for hpcrl: the VecEnv protocol, pure-torch envs, a gymnasium adapter.

This package stands alone: it imports nothing from the rest of hpcrl. gymnasium is imported only
when a ``gym:<Id>`` env (or ``GymVecEnv``) is requested.

    env = make_env("pendulum", num_envs=64, device="cuda", seed=0)
    obs = env.reset()
    res = env.step(action)  # StepResult(obs, next_obs, reward, terminated, truncated)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import EpisodeStats, EpisodeSummary, StepResult, TorchVecEnv, VecEnv, check_num_envs
from .cartpole import CartPole, CartPoleSwingUp
from .pendulum import Pendulum

__all__ = [
    "CartPole",
    "CartPoleSwingUp",
    "EpisodeStats",
    "EpisodeSummary",
    "GymVecEnv",
    "Pendulum",
    "StepResult",
    "TorchVecEnv",
    "VecEnv",
    "env_names",
    "make_env",
]

_REGISTRY: dict[str, Callable[..., VecEnv]] = {
    "pendulum": Pendulum,
    "cartpole": CartPole,
    "cartpole_swingup": CartPoleSwingUp,
}
GYM_PREFIX = "gym:"


def env_names() -> list[str]:
    """Built-in names, plus the ``gym:<Id>`` pattern."""
    return [*sorted(_REGISTRY), GYM_PREFIX + "<Id>"]


def make_env(
    name: str,
    num_envs: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> VecEnv:
    """Build a VecEnv by name: "pendulum", "cartpole", "cartpole_swingup" or "gym:<gymnasium id>".

    ``kwargs`` go to the env's constructor (e.g. ``dtype``, ``max_episode_steps`` for the torch
    envs; ``gym.make_vec`` keyword arguments for gym ids). Call ``reset()`` before ``step()``.
    """
    check_num_envs(num_envs)
    if not isinstance(name, str):
        raise ValueError(f"env name must be a string, got {name!r}; known: {', '.join(env_names())}")
    if name.startswith(GYM_PREFIX):
        gym_id = name[len(GYM_PREFIX) :]
        if not gym_id:
            raise ValueError(f"empty gymnasium id in {name!r}; expected e.g. 'gym:HalfCheetah-v5'")
        from .gym_adapter import GymVecEnv

        return GymVecEnv(gym_id, num_envs, device, seed=seed, **kwargs)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(env_names())}") from None
    return factory(num_envs, device, seed=seed, **kwargs)


def __getattr__(name: str) -> Any:
    # Lazy: importing hpcrl.envs must not require gymnasium.
    if name == "GymVecEnv":
        from .gym_adapter import GymVecEnv

        return GymVecEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
