"""Single-process synchronous PPO (collect -> update -> repeat): the baseline, and the reference the
detached ``--lag 0`` run with 1 maker : 1 trainer must reproduce.

Seed discipline (the detached roles copy it exactly; with it and lag 0 they see the same numbers):

* ``model = workload.build_model(seed, device)`` on every rank (trainer and maker models start equal);
* ``collector = workload.make_collector(rank_seed=seed, device)``;
* maker generator (action sampling) ``torch.Generator().manual_seed(seed + 1)``;
* learner generator (minibatch shuffling) ``torch.Generator().manual_seed(seed + 2)``;
* iteration ``k`` collects with the weights produced by update ``k - 1`` (policy version ``k``) and
  then runs update ``k`` on exactly that one batch.

Maker 0 and trainer 0 of a detached run use exactly these seeds; other makers and trainers offset
``seed`` by their index (``hpcrl.ppo.maker``, ``hpcrl.ppo.trainer``) so their streams differ.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .workload import PPOConfig, Workload
from .workload_plugin import as_workload


class NoGradAverage:
    """Gradient averaging over a plane of one. Unlike a world-size-1 ``hpcrl.comm.GradAverager`` it
    is safe inside a process that belongs to a larger initialised world."""

    def all_reduce(self) -> None:
        pass


class SyncPPO:
    """The synchronous loop's state: model, collector, learner and the two generators."""

    def __init__(self, workload: Workload, cfg: PPOConfig, seed: int, device: torch.device | str) -> None:
        device = torch.device(device)
        workload = as_workload(workload)
        self.model = workload.build_model(seed, device)
        self.collector = workload.make_collector(rank_seed=seed, device=device)
        self.learner = workload.make_learner(self.model, cfg, NoGradAverage())
        self.maker_generator = torch.Generator().manual_seed(seed + 1)
        self.learner_generator = torch.Generator().manual_seed(seed + 2)
        self.iteration = 0
        self.env_steps = 0.0
        self.seed = seed

    def step(self) -> dict[str, float]:
        """One collect + update. The row: ``iteration`` (= policy version after the update),
        cumulative ``env_steps``, this rollout's ``episodes``, ``episode_return_sum`` and
        ``episode_return`` (their mean, NaN if none finished), then the collector's other stats and
        the learner's stats."""
        self.collector.assign(self.iteration, self.seed)  # iteration k is batch k, as trainer 0's credit k
        batch, rollout = self.collector.collect(self.model, self.maker_generator)
        stats = self.learner.update([batch], self.learner_generator)
        self.iteration += 1
        self.env_steps += rollout["env_steps"]
        episodes = rollout["episodes"]
        row = {
            **rollout,
            "iteration": float(self.iteration),
            "env_steps": self.env_steps,
            "episode_return": rollout["episode_return_sum"] / episodes if episodes > 0 else math.nan,
        }
        row.update(stats)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {
            "collector": self.collector.state_dict(),
            "learner": self.learner.state_dict(),
            "maker_generator": self.maker_generator.get_state(),
            "learner_generator": self.learner_generator.get_state(),
            "iteration": self.iteration,
            "env_steps": self.env_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.load_state_dict(state["collector"])
        self.learner.load_state_dict(state["learner"])
        self.maker_generator.set_state(state["maker_generator"])
        self.learner_generator.set_state(state["learner_generator"])
        self.iteration = int(state["iteration"])
        self.env_steps = float(state["env_steps"])


def train_sync(
    workload: Workload,
    cfg: PPOConfig,
    iterations: int,
    seed: int,
    device: torch.device | str = "cpu",
    until: Callable[[list[dict[str, float]]], bool] | None = None,
) -> list[dict[str, float]]:
    """Run ``iterations`` synchronous PPO iterations (fewer if ``until(rows)`` turns true after
    one) and return one stats row per iteration (see :meth:`SyncPPO.step`)."""
    run = SyncPPO(workload, cfg, seed, device)
    rows: list[dict[str, float]] = []
    for _ in range(iterations):
        rows.append(run.step())
        if until is not None and until(rows):
            break
    return rows
