"""Workload registry: ``make_workload(name, **kwargs)``.

* ``cartpole``: :class:`VectorEnvWorkload` on the discrete CartPole (8 envs x 32 steps, hidden 64);
  pair it with ``workload.default_config()`` (SB3-zoo hyper-parameters).
* ``swingup`` (alias ``continuous``): the continuous cart-pole swing-up, 16 envs x 64 steps.
* ``pendulum``: Pendulum, same sizes. A weak PPO task without reward normalisation (which this
  workload does not do): no clear progress within 50k env steps.
* ``lm``: token-level LM PPO, ``hpcrl.ppo.workloads.lm.LMWorkload``, imported only when asked for.

``kwargs`` override the constructor's arguments (e.g. ``num_envs=16``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..workload import Workload
from .vector_env import VectorEnvWorkload

__all__ = ["VectorEnvWorkload", "make_workload", "shared_imports", "workload_names"]


def _vector(env: str, name: str, **defaults: Any) -> Callable[..., Workload]:
    def make(**kwargs: Any) -> VectorEnvWorkload:
        return VectorEnvWorkload(**{"env": env, "name": name, **defaults, **kwargs})

    return make


# Longer rollouts than CartPole's: continuous control needs more samples per update.
_CONTINUOUS = {"num_envs": 16, "rollout_len": 64}


def _lm(**kwargs: Any) -> Workload:
    from .lm import LMWorkload  # lazy: the LM workload is optional and heavier

    return LMWorkload(**kwargs)


def _hf(**kwargs: Any) -> Workload:
    from .hf import RegisteredHFWorkload  # lazy: needs transformers (pip install '.[hf]')

    return RegisteredHFWorkload(**kwargs)


_REGISTRY: dict[str, Callable[..., Workload]] = {
    "cartpole": _vector("cartpole", "cartpole"),
    "swingup": _vector("cartpole_swingup", "swingup", **_CONTINUOUS),
    "continuous": _vector("cartpole_swingup", "continuous", **_CONTINUOUS),
    "pendulum": _vector("pendulum", "pendulum", **_CONTINUOUS),
    "lm": _lm,
    "hf": _hf,
}


# Only what checking the workload imports anyway (its config and tokenizer): the model code
# (transformers.modeling_utils, ~4 s on this machine) goes with Workload.rank_modules to the ranks' server, so a
# launcher that refuses bad input never loads it.
_SHARED_IMPORTS: dict[str, tuple[str, ...]] = {
    "hf": ("hpcrl.ppo.workloads.hf", "transformers.models.auto"),
}


def shared_imports(name: str) -> tuple[str, ...]:
    """Modules that both the launcher (checking the workload) and every rank of a registered workload
    import: a launcher imports them before it forks its ranks' server (:mod:`hpcrl.comm.prefork`), so a
    run imports them once. Modules only the ranks need are the workload's ``rank_modules``."""
    return _SHARED_IMPORTS.get(name, ())


def workload_names() -> list[str]:
    return sorted(_REGISTRY)


def make_workload(name: str, **kwargs: Any) -> Workload:
    """Build a workload by registry name; unknown names raise ValueError listing the known ones."""
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names())}") from None
    return factory(**kwargs)
