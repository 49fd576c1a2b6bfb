"""Rank functions for the FastSAC data-parallel tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses

import torch

from hpcrl.comm import Plane, all_reduce_sum_, init_distributed
from hpcrl.replay import Batch
from hpcrl.sac import FastSAC, UpdateNoise, preset
from hpcrl.sac.normalizer import ObsNormalizer

OBS, ACT = 5, 2
UPDATES = 6
GLOBAL_BATCH = 32


def small_config(mode: str):
    return preset("pendulum", actor_hidden=32, critic_hidden=32, num_atoms=11, v_min=-5.0, v_max=5.0,
                  grad_sync=mode, policy_frequency=2, tau=0.05, weight_decay=1e-3)


def global_data(step: int):
    """The global batch and noise of update ``step`` (identical on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    B = GLOBAL_BATCH
    batch = Batch(obs=torch.randn(B, OBS, generator=g), action=torch.rand(B, ACT, generator=g) * 2 - 1,
                  reward=torch.randn(B, generator=g), next_obs=torch.randn(B, OBS, generator=g),
                  discount=(torch.rand(B, generator=g) > 0.2).float() * 0.98,
                  n=torch.ones(B, dtype=torch.int64))
    noise = UpdateNoise(torch.randn(B, ACT, generator=g), torch.randn(B, ACT, generator=g))
    return batch, noise


def rows(x, rank: int, world: int):
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per]


def run_updates(mode: str, rank: int = 0, world: int = 1, ctx=None) -> dict:
    """K updates on this rank's share of each global batch; returns grads of update 0 and final state."""
    torch.manual_seed(0)
    plane = ctx.device_plane if ctx is not None else Plane.local("device")
    agent = FastSAC(small_config(mode), OBS, ACT, -torch.ones(ACT), torch.ones(ACT), torch.device("cpu"), plane=plane)
    first_grads: dict[str, torch.Tensor] = {}
    real_step = agent.critic_opt.step

    def recording_step(*a, **k):
        if not first_grads:
            for name, p in agent.critic.named_parameters():
                first_grads[name] = p.grad.clone()
            first_grads["log_alpha"] = agent.log_alpha.grad.clone()
        return real_step(*a, **k)

    agent.critic_opt.step = recording_step
    norm = ObsNormalizer(OBS)
    for step in range(UPDATES):
        batch, noise = global_data(step)
        mine = Batch(*[None if t is None else rows(t, rank, world) for t in batch])
        agent.update(mine, UpdateNoise(*[rows(t, rank, world) for t in noise]))
        norm.update(rows(batch.obs * 3 + 1, rank, world), (lambda t: all_reduce_sum_([t], plane)) if world > 1 else None)
    return {
        "grads": first_grads,
        "actor": {k: v.clone() for k, v in agent.actor.state_dict().items()},
        "critic": {k: v.clone() for k, v in agent.critic.state_dict().items()},
        "critic_target": {k: v.clone() for k, v in agent.critic_target.state_dict().items()},
        "log_alpha": agent.log_alpha.detach().clone(),
        "normalizer": {k: v.clone() for k, v in norm.state_dict().items()},
        "counters": dataclasses.astuple(agent.counters),
    }


def dp_rank(modes: list[str]) -> dict:
    ctx = init_distributed(timeout_s=60)
    return {mode: run_updates(mode, ctx.rank, ctx.world_size, ctx) for mode in modes}
