"""A real env with bad data for the multi-rank non-finite test: hpcrl's torch Pendulum whose reward
turns NaN at its 7th step, only in the copy built with seed 2 (rank 1 of a 2-rank run with 2 envs
per rank: ranks seed their envs with seed + rank * envs_per_rank)."""

from __future__ import annotations

from hpcrl.envs.pendulum import Pendulum


class NaNRewardOnSeed2(Pendulum):
    def __init__(self, num_envs, device="cpu", seed=0, **kwargs):
        super().__init__(num_envs, device=device, seed=seed, **kwargs)
        self.poisoned, self.calls = seed == 2, 0

    def step(self, action):
        result = super().step(action)
        self.calls += 1
        if self.poisoned and self.calls == 7:
            result.reward[1] = float("nan")
        return result
