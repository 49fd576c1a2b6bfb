"""Events of a FastSAC run, for whoever watches it (benchmarks, dashboards, tests).

``hpcrl.sac.train(cfg, events=callback)`` calls ``callback(event)`` on every rank, from the training
loop, as :mod:`hpcrl.ppo.events` does for detached PPO. A callback must be quick and must not raise;
under ``--nproc`` / ``hpcrl.comm.spawn`` it must be picklable (a module-level function or an instance
of a module-level class). ``time`` is ``time.time()`` when the event happened.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Union


@dataclass(frozen=True)
class UpdatesDone:
    """One vector step's learner updates on this rank (``num_updates`` of them, each: sample, normalise,
    update with its gradient averaging, and the replica check when one is due)."""

    time: float
    rank: int
    vector_step: int
    """Vector steps done, this one included."""
    updates: int
    seconds: float
    """Wall time of the updates on the host (device work still queued at the end is not waited for)."""

    @property
    def iteration(self) -> int:
        """The old name of :attr:`vector_step`, kept for existing callbacks."""
        warnings.warn("UpdatesDone.iteration is now UpdatesDone.vector_step", DeprecationWarning, stacklevel=2)
        return self.vector_step


@dataclass(frozen=True)
class RowLogged:
    """A training metrics row, reduced over the ranks (every rank sees the same row)."""

    time: float
    rank: int
    row: dict[str, Any]


@dataclass(frozen=True)
class EvalDone:
    """An evaluation (``--eval-every`` and the one at the end), reduced over the ranks."""

    time: float
    rank: int
    env_steps: int
    eval_return: float
    seconds: float


Event = Union[UpdatesDone, RowLogged, EvalDone]
Events = Callable[[Event], None]


def ignore(_event: Event) -> None:
    """The default callback."""
