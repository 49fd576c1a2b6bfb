"""Batched environments for hpcrl: the VecEnv protocol, pure-torch envs and adapters.

This package stands alone: it imports nothing from the rest of hpcrl. Each adapter's simulator is
imported only when an env of its kind is requested. Names ``make_env`` resolves:

* ``pendulum``, ``cartpole``, ``cartpole_swingup``: the built-in pure-torch envs;
* ``gym:<Id>``: a gymnasium env stepped through numpy (``GymVecEnv``);
* ``playground:<EnvName>``: MuJoCo Playground, vmapped and jit-compiled in JAX (``PlaygroundVecEnv``);
* ``torchvec:<Id>``: a gymnasium-registered env that steps batches of torch tensors itself, the
  IsaacLab / ManiSkill3 / Genesis convention (``TorchNativeVecEnv``);
* ``package.module:Class``: a user VecEnv subclass, built as ``Class(num_envs, device=..., seed=...)``.

The adapters take options after ``?``: ``playground:CheetahRun?impl=jax&episode_length=500``,
``torchvec:PickCube-v1?obs_mode=state``; values parse as int, float, true/false/none, else string, and
go to the adapter like ``make_env`` keyword arguments (which win over them).

    env = make_env("pendulum", num_envs=64, device="cuda", seed=0)
    obs = env.reset()
    res = env.step(action)  # StepResult(obs, next_obs, reward, terminated, truncated)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .base import EpisodeStats, EpisodeSummary, StepResult, TorchVecEnv, VecEnv, check_num_envs, first_episode_returns
from .cartpole import CartPole, CartPoleSwingUp
from .pendulum import Pendulum

__all__ = [
    "CartPole",
    "CartPoleSwingUp",
    "EpisodeStats",
    "first_episode_returns",
    "EpisodeSummary",
    "GymVecEnv",
    "Pendulum",
    "PlaygroundVecEnv",
    "StepResult",
    "TorchNativeVecEnv",
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
PLAYGROUND_PREFIX = "playground:"
TORCHVEC_PREFIX = "torchvec:"
_PREFIXES = (GYM_PREFIX, PLAYGROUND_PREFIX, TORCHVEC_PREFIX)


def env_names() -> list[str]:
    """Built-in names, plus the adapter and ``module:Class`` patterns."""
    return [*sorted(_REGISTRY), GYM_PREFIX + "<Id>", PLAYGROUND_PREFIX + "<EnvName>",
            TORCHVEC_PREFIX + "<Id>", "<package.module>:<VecEnvClass>"]


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_options(name: str) -> tuple[str, dict[str, Any]]:
    """``"playground:CheetahRun?impl=jax&episode_length=500"`` -> ("playground:CheetahRun", {...})."""
    base, sep, query = name.partition("?")
    options: dict[str, Any] = {}
    if sep:
        for item in query.split("&"):
            key, eq, val = item.partition("=")
            if not eq or not key.isidentifier():
                raise ValueError(f"env option {item!r} in {name!r} is not key=value; e.g. {base}?impl=jax")
            options[key] = _value(val)
    return base, options


def _user_class(name: str) -> Callable[..., VecEnv]:
    """``package.module:Class`` -> the VecEnv subclass, or a one-line ValueError saying what is wrong."""
    module_name, _, attr = name.partition(":")
    hint = "expected 'package.module:Class' naming a VecEnv subclass"
    if not module_name or not attr or not attr.isidentifier():
        raise ValueError(f"env {name!r}: {hint}; or one of {', '.join(env_names())}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env {name!r}: cannot import module {module_name!r} ({err}); {hint}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"env {name!r}: module {module_name!r} has no attribute {attr!r}; {hint}")
    if not (isinstance(cls, type) and issubclass(cls, VecEnv)):
        raise ValueError(f"env {name!r}: {module_name}.{attr} is {type(cls).__name__}, not a VecEnv subclass")
    return cls


def make_env(
    name: str,
    num_envs: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> VecEnv:
    """Build a VecEnv by name (see the module docstring for the names and ``?key=value`` options).

    ``kwargs`` go to the env's constructor (e.g. ``dtype``, ``max_episode_steps`` for the torch
    envs; ``gym.make_vec`` keyword arguments for gym ids; config overrides for Playground). Bad names
    and options raise a one-line ValueError. Call ``reset()`` before ``step()``.
    """
    check_num_envs(num_envs)
    if not isinstance(name, str):
        raise ValueError(f"env name must be a string, got {name!r}; known: {', '.join(env_names())}")
    if name in _REGISTRY:
        return _REGISTRY[name](num_envs, device, seed=seed, **kwargs)
    base, options = split_options(name)
    options.update(kwargs)
    for prefix in _PREFIXES:
        if base.startswith(prefix):
            ident = base[len(prefix) :]
            if not ident:
                kind, example = _EXAMPLE[prefix]
                raise ValueError(f"empty {kind} id in {name!r}; expected e.g. '{prefix}{example}'")
            if prefix == GYM_PREFIX:
                from .gym_adapter import GymVecEnv as cls
            elif prefix == PLAYGROUND_PREFIX:
                from .playground import PlaygroundVecEnv as cls
            else:
                from .torch_native import TorchNativeVecEnv as cls
            return cls(ident, num_envs, device, seed=seed, **options)
    if ":" not in base:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(env_names())}")
    cls = _user_class(base)
    try:
        return cls(num_envs, device=device, seed=seed, **options)
    except TypeError as err:
        raise ValueError(
            f"env {name!r}: {cls.__name__}(num_envs, device=..., seed=...) failed ({err}); "
            "a user VecEnv must take these arguments"
        ) from None


_EXAMPLE = {GYM_PREFIX: ("gymnasium", "HalfCheetah-v5"), PLAYGROUND_PREFIX: ("Playground", "CartpoleBalance"),
            TORCHVEC_PREFIX: ("gymnasium", "mani_skill.envs:PickCube-v1")}


def __getattr__(name: str) -> Any:
    # Lazy: importing hpcrl.envs must not require gymnasium.
    if name == "GymVecEnv":
        from .gym_adapter import GymVecEnv

        return GymVecEnv
    if name == "PlaygroundVecEnv":
        from .playground import PlaygroundVecEnv

        return PlaygroundVecEnv
    if name == "TorchNativeVecEnv":
        from .torch_native import TorchNativeVecEnv

        return TorchNativeVecEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
