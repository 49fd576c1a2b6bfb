"""Rank -> role map of a detached-PPO job, checked before submission.

``python -m hpcrl.ppo`` gives ranks ``[0, T)`` the trainer role and ``[T, T+M)`` the maker role
(:func:`hpcrl.core.conventions.ppo_role`) and exits 2 when the launcher started a world of another size;
a launcher job of ``nodes x tasks_per_node`` tasks has to match ``--trainers T --makers M`` (defaults
:data:`hpcrl.core.conventions.DEFAULT_TRAINERS` / :data:`~hpcrl.core.conventions.DEFAULT_MAKERS`, the trainer's
own). Checking that here turns a job that would fail after queueing into an error at submission.
"""

from __future__ import annotations

from typing import Sequence

from hpcrl.run.cli import flag_value
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import DEFAULT_MAKERS, DEFAULT_TRAINERS

from .errors import LaunchError

_DEFAULTS = {"trainers": DEFAULT_TRAINERS, "makers": DEFAULT_MAKERS}


def ppo_groups(trainer_args: Sequence[str]) -> tuple[int, int]:
    """(trainers, makers) that ``python -m hpcrl.ppo *trainer_args`` will run."""
    counts = []
    for name, default in _DEFAULTS.items():
        try:
            raw = flag_value(list(trainer_args), f"--{name}")
            counts.append(int(raw) if raw is not None else default)
        except ConfigError as err:  # the flag without its value
            raise LaunchError(str(err)) from None
        except ValueError:
            raise LaunchError(f"--{name} {raw!r} is not an integer") from None
    trainers, makers = counts
    if trainers < 1 or makers < 1:
        raise LaunchError(f"--trainers {trainers} --makers {makers}: detached PPO needs at least one of each")
    return trainers, makers


def check_ppo_world(trainer_args: Sequence[str], world_size: int) -> tuple[int, int]:
    """(trainers, makers); LaunchError when they do not add up to the job's ``world_size`` tasks."""
    trainers, makers = ppo_groups(trainer_args)
    if trainers + makers != world_size:
        raise LaunchError(f"--trainers {trainers} + --makers {makers} = {trainers + makers} ranks, but the job "
                          f"starts {world_size} task(s) (nodes x tasks_per_node): ranks [0, {trainers}) train, "
                          "the rest make experience; change the counts or the job size")
    return trainers, makers
