"""Rank functions for the FastSAC data-parallel tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses

import torch

from hpcrl.comm import Plane, all_reduce_sum_, init_distributed
from hpcrl.envs import TorchVecEnv
from hpcrl.replay import Batch
from hpcrl.sac import FastSAC, UpdateNoise, preset
from hpcrl.sac.normalizer import ObsNormalizer

OBS, ACT = 5, 2
UPDATES = 6
GLOBAL_BATCH = 32


def small_config(mode: str):
    return preset("pendulum", actor_hidden=32, critic_hidden=32, num_atoms=11, v_min=-5.0, v_max=5.0,
                  grad_average=mode, policy_frequency=2, tau=0.05, weight_decay=1e-3)


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


def run_updates(mode: str, rank: int = 0, world: int = 1, ctx=None, **overrides) -> dict:
    """K updates on this rank's share of each global batch; returns grads of update 0 and final state."""
    torch.manual_seed(0)
    plane = ctx.device_plane if ctx is not None else Plane.local("device")
    agent = FastSAC(dataclasses.replace(small_config(mode), **overrides), OBS, ACT, -torch.ones(ACT), torch.ones(ACT), torch.device("cpu"), plane=plane)
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


def overlap_rank() -> dict:
    """FastSAC on 2 ranks with and without --overlap-grad-average (flat buffers and view mode), and a bare
    GradAverager cut into small buckets: its overlapped all-reduce against the plain one."""
    from hpcrl.comm import GradAverager
    from hpcrl.sac.flat import FlatParams

    ctx = init_distributed(timeout_s=60, shared_memory=False)  # gloo: overlap is off on a shared-memory plane
    out = {f"{mode}_{ov}": run_updates(mode, ctx.rank, ctx.world_size, ctx, overlap_grad_average=ov)
           for mode in ("flat", "view") for ov in (False, True)}
    torch.manual_seed(ctx.rank)  # different data per rank
    x = torch.randn(16, 8)
    grads, started = {}, 0
    for ov in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                                  torch.nn.Linear(64, 3))
        flat = FlatParams(list(net.parameters()))
        avg = GradAverager(net.parameters(), "flat", plane=ctx.device_plane, grad_buffers=flat.grad_buffers.values(),
                           overlap=ov, bucket_bytes=512)
        for _ in range(2):  # the second round checks the buckets re-arm
            avg.zero_grad()
            net(x).square().sum().backward()
            if ov:
                started = sum(piece.work is not None for piece in avg._pieces)
                out["pieces"] = len(avg._pieces)
            avg.all_reduce()
        grads[ov] = flat.grad_buffers[torch.float32].clone()
    out["bare"] = grads
    out["started_in_backward"] = started
    return out


# -- the training recipe (critic obs, fp16 + scaler, clipping, shared state) -----------------------------

CDIM = 7  # privileged critic observation width of the equivalence tests


def recipe_data(step: int) -> tuple[Batch, UpdateNoise]:
    """global_data plus privileged critic observations (a different function of the state than obs)."""
    batch, noise = global_data(step)
    g = torch.Generator().manual_seed(5000 + step)
    B = GLOBAL_BATCH
    return batch._replace(critic_obs=torch.randn(B, CDIM, generator=g),
                          next_critic_obs=torch.randn(B, CDIM, generator=g)), noise


def recipe_updates(opts: dict, rank: int = 0, world: int = 1, ctx=None) -> dict:
    """UPDATES updates with critic obs and the recipe options in ``opts`` (amp, max_grad_norm; inf_rank /
    inf_step: put an inf into that rank's critic gradient before the all-reduce of that update)."""
    torch.manual_seed(0)
    plane = ctx.device_plane if ctx is not None else Plane.local("device")
    cfg = dataclasses.replace(small_config("flat"), amp=opts.get("amp", "none"),
                              max_grad_norm=opts.get("max_grad_norm", 0.0))
    agent = FastSAC(cfg, OBS, ACT, -torch.ones(ACT), torch.ones(ACT), torch.device("cpu"), plane=plane,
                    critic_obs_dim=opts.get("cdim", CDIM))
    real_all_reduce = agent.critic_average.all_reduce

    def maybe_inject():
        if opts.get("inf_rank") == rank and agent.counters.critic_steps == opts.get("inf_step"):
            next(agent.critic.parameters()).grad.view(-1)[0] = float("inf")
        real_all_reduce()

    agent.critic_average.all_reduce = maybe_inject
    norms, scales, after_inf = [], [], None  # noqa
    for step in range(UPDATES):
        batch, noise = recipe_data(step)
        if opts.get("cdim", CDIM) is None:
            batch = batch._replace(critic_obs=None, next_critic_obs=None)
        before = {k: v.clone() for k, v in agent.critic.state_dict().items()}
        out = agent.update(Batch(*[None if t is None else rows(t, rank, world) for t in batch]),
                           UpdateNoise(*[rows(t, rank, world) for t in noise]))
        norms.append(float(out["critic_grad_norm"]))
        if "grad_scale" in out:
            scales.append(float(out["grad_scale"]))
        if step == opts.get("inf_step"):
            after_inf = all(torch.equal(before[k], v) for k, v in agent.critic.state_dict().items()
                            if not k.endswith("support"))
    return {
        "actor": {k: v.clone() for k, v in agent.actor.state_dict().items()},
        "critic": {k: v.clone() for k, v in agent.critic.state_dict().items()},
        "critic_target": {k: v.clone() for k, v in agent.critic_target.state_dict().items()},
        "log_alpha": agent.log_alpha.detach().clone(), "norms": norms, "scales": scales,
        "critic_unchanged_at_inf": after_inf, "counters": dataclasses.astuple(agent.counters),
    }


def recipe_rank(opts_list: list[dict]) -> list[dict]:
    ctx = init_distributed(timeout_s=60)
    return [recipe_updates(o, ctx.rank, ctx.world_size, ctx) for o in opts_list]


class ToyPrivileged(TorchVecEnv):
    """A point mass that must sit on a hidden goal: the actor sees [pos, vel], the critic also the goal
    (information the actor obs lack). Shared state: a curriculum ``level`` (the goal range) that every
    rank raises by its own episode ends; the learner reduces it across ranks each step."""

    state_dim = 3
    obs_dim = 2
    critic_obs_dim = 3
    INSTANCES: list = []

    def __init__(self, num_envs: int, device="cpu", *, seed: int = 0, max_episode_steps: int = 20, **kw) -> None:
        super().__init__(num_envs, device=device, seed=seed, max_episode_steps=max_episode_steps, **kw)
        self.action_dim = 1
        self.action_low = -torch.ones(1, device=self.device)
        self.action_high = torch.ones(1, device=self.device)
        self.level = torch.full((), 0.5, device=self.device)
        self._seed = int(seed)
        self._just_done = torch.zeros(num_envs, dtype=torch.bool, device=self.device)
        ToyPrivileged.INSTANCES.append(self)

    def _initial_state(self):
        s = self._rand(self.num_envs, 3) * 2 - 1
        s[:, 1] = 0
        s[:, 2] = s[:, 2] * self.level
        return s

    def _prepare_action(self, action):
        return action.to(self.device, self.dtype).reshape(self.num_envs).clamp(-1, 1)

    def _transition(self, state, a):
        pos, vel, goal = state.unbind(-1)
        vel = 0.9 * vel + 0.1 * a
        pos = pos + 0.1 * vel
        reward = -(pos - goal).square() - 0.01 * a.square()
        return torch.stack([pos, vel, goal], -1), reward, torch.zeros_like(pos, dtype=torch.bool)

    def _observation(self, state):
        return state[:, :2]

    def observe_critic(self):
        return self.state.clone()

    def step(self, action):
        before = self.state
        result = super().step(action)
        done = result.done
        # next_critic_obs: the true final state where done (the same rule as next_obs)
        final = self._transition(before, self._prepare_action(action))[0]
        self.level = self.level + 0.01 * done.float().sum() * (1 + self._seed)  # ranks drift apart unreduced
        return dataclasses.replace(result, critic_obs=self.state.clone(), next_critic_obs=final)

    def shared_state(self):
        return {"level": self.level}

    def load_shared_state(self, state):
        self.level = state["level"].clone()

    def state_dict(self):
        return {**super().state_dict(), "level": self.level.clone()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.level = state["level"].to(self.device).clone()


def register_toy() -> None:
    from hpcrl import envs

    envs._REGISTRY["toy_privileged"] = ToyPrivileged  # tests only: no public registration hook yet


def train_rank(cfg) -> dict:
    """One rank of hpcrl.sac.train on the toy env; returns the final row and the env's shared state."""
    register_toy()
    from hpcrl.sac.run import train

    ToyPrivileged.INSTANCES.clear()
    row = train(cfg)
    return {"row": row, "level": float(ToyPrivileged.INSTANCES[0].level)}
