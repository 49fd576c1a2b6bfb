"""Events of a detached-PPO run, for whoever watches it (benchmarks, dashboards, tests).

``hpcrl.ppo.train(cfg, events=callback)`` calls ``callback(event)`` on every rank it runs on, from
the thread where the event happened (compute thread, or the publisher thread for
:class:`WeightsPublished`). A callback must be quick and must not raise; under ``--nproc`` /
``hpcrl.comm.spawn`` it must be picklable (a module-level function or an instance of a module-level
class). ``time`` is ``time.time()`` when the event happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union


@dataclass(frozen=True)
class BatchReceived:
    """A trainer took a batch off its queue (in credit order) for the current step, or dropped it as stale."""

    time: float
    trainer: int
    maker: int
    version: int
    """Behaviour policy version the batch was collected with."""
    lag: int
    """Trainer version minus behaviour version."""
    wait_s: float
    """How long the trainer waited for this batch."""
    samples: int
    stale: bool


@dataclass(frozen=True)
class RowLogged:
    """A metrics row, reduced over the trainers (every trainer sees the same row)."""

    time: float
    trainer: int
    row: dict[str, Any]


@dataclass(frozen=True)
class WeightsPublished:
    """Trainer 0 delivered one version to the makers (publisher thread)."""

    time: float
    version: int
    seconds: float
    nbytes: int
    makers: int
    transport: str
    """``"broadcast"`` (one collective over the weight plane) or ``"point-to-point"`` (after a loss)."""


@dataclass(frozen=True)
class RolloutDone:
    """A maker finished a rollout: it waited (credit, weights, send queue) from ``wait_start`` to
    ``collect_start``, then collected until ``time``."""

    time: float
    maker: int
    version: int
    wait_start: float
    collect_start: float
    samples: int


Event = Union[BatchReceived, RowLogged, WeightsPublished, RolloutDone]
Events = Callable[[Event], None]


def ignore(_event: Event) -> None:
    """The default callback."""
