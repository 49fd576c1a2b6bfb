"""CleanRL-style single-file FastSAC (learner and training loop): the baseline of benchmarks/sac/sac_throughput.py.

This is the FastSAC a user would write without hpcrl, in the style of CleanRL's
``sac_continuous_action.py`` and holosoma's ``fast_sac`` (docs/holosoma.md#the-learner,
#data-parallelism), with the SAME networks, losses and update schedule as ``hpcrl.sac.FastSAC``:

* actor: LayerNorm+SiLU trunk (H, H/2, H/4), zero-initialised mean / log-std heads, log-std squashed
  into [log_std_min, log_std_max], tanh-squashed Gaussian through ``torch.distributions.Normal``
  (``rsample`` / ``log_prob``), holosoma's log-density (tanh and action-scale Jacobians);
* critic: ``num_q`` independent C51 heads (LayerNorm+SiLU trunk, ``num_atoms`` logits) in a ModuleList,
  evaluated in a Python loop and stacked; each head trained against its own target head; the
  projection is holosoma's (per head, flattened ``[B*atoms]`` buffer, row offsets from
  ``torch.linspace``, two ``index_add_``);
* losses: cross-entropy summed over heads; entropy folded into the reward; actor maximises the mean
  of the heads' expected Q; alpha autotuned from the next-state log-probs, every critic step;
* schedule: critic (+alpha) step and Polyak update every call, actor step every ``policy_frequency``.

Written the way such code usually is: a per-field numpy replay buffer storing obs AND next_obs with
fancy-indexed sampling (SB3/CleanRL ``ReplayBuffer``), separate ``torch.optim`` optimisers with their
default implementation (no ``fused=`` / ``foreach=`` flags), ``zero_grad()`` + ``backward()`` per
loss, a Polyak update as a Python loop over parameters, the actor loss backpropagated through the
(unfrozen) critic as CleanRL and holosoma do, and for data parallelism holosoma's gradient
all-reduce (``torch.cat`` of the grads -> ``all_reduce`` -> ``div_`` -> per-tensor ``copy_``, one
collective per model, a separate one for log-alpha).

One deliberate deviation from holosoma's code: the exact-atom case of the projection uses CleanRL
C51's ``(l == u)`` term instead of holosoma's two ``torch.where`` shifts, which double the mass when a
target lands exactly on an interior atom. Same cost, correct math, and identical to hpcrl.

Only 1-step returns (the benchmark's presets use n_step=1); ``discount = gamma * (1 - terminated)``.
``update(data, noise)`` takes optional fixed noise so that one update can be checked against hpcrl's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# -- replay ------------------------------------------------------------------------------------------

class ReplayBufferSamples(NamedTuple):
    observations: torch.Tensor
    actions: torch.Tensor
    next_observations: torch.Tensor
    dones: torch.Tensor  # 1.0 where the episode terminated (no bootstrap); truncations bootstrap
    rewards: torch.Tensor


class ReplayBuffer:
    """SB3/CleanRL-style ring: one numpy array per field, [buffer_size, n_envs, dim]."""

    def __init__(self, buffer_size: int, n_envs: int, obs_dim: int, action_dim: int, seed: int = 0):
        self.buffer_size, self.n_envs = buffer_size, n_envs
        self.observations = np.zeros((buffer_size, n_envs, obs_dim), dtype=np.float32)
        self.next_observations = np.zeros((buffer_size, n_envs, obs_dim), dtype=np.float32)
        self.actions = np.zeros((buffer_size, n_envs, action_dim), dtype=np.float32)
        self.rewards = np.zeros((buffer_size, n_envs), dtype=np.float32)
        self.dones = np.zeros((buffer_size, n_envs), dtype=np.float32)
        self.pos, self.full = 0, False
        self.rng = np.random.default_rng(seed)

    def add(self, obs, next_obs, action, reward, terminated) -> None:
        self.observations[self.pos] = np.array(obs)
        self.next_observations[self.pos] = np.array(next_obs)
        self.actions[self.pos] = np.array(action)
        self.rewards[self.pos] = np.array(reward)
        self.dones[self.pos] = np.array(terminated)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0

    def sample(self, batch_size: int) -> ReplayBufferSamples:
        upper = self.buffer_size if self.full else self.pos
        batch_inds = self.rng.integers(0, upper, size=batch_size)
        env_inds = self.rng.integers(0, self.n_envs, size=batch_size)
        return ReplayBufferSamples(
            torch.from_numpy(self.observations[batch_inds, env_inds, :]),
            torch.from_numpy(self.actions[batch_inds, env_inds, :]),
            torch.from_numpy(self.next_observations[batch_inds, env_inds, :]),
            torch.from_numpy(self.dones[batch_inds, env_inds]),
            torch.from_numpy(self.rewards[batch_inds, env_inds]),
        )


class EmpiricalNormalization(nn.Module):
    """holosoma/FastTD3-style running mean/std of observations (Chan's merge), (x - mean) / (std + eps)."""

    def __init__(self, dim: int, eps: float = 1e-2):
        super().__init__()
        self.eps = eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total
        self.count = total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.var.sqrt() + self.eps)


# -- networks ----------------------------------------------------------------------------------------

def layer_norm_mlp(in_dim: int, hidden: int) -> list[nn.Module]:
    return [nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.SiLU(),
            nn.Linear(hidden, hidden // 2), nn.LayerNorm(hidden // 2), nn.SiLU(),
            nn.Linear(hidden // 2, hidden // 4), nn.LayerNorm(hidden // 4), nn.SiLU()]


class Actor(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden, action_low, action_high, log_std_min=-5.0, log_std_max=0.0):
        super().__init__()
        self.net = nn.Sequential(*layer_norm_mlp(obs_dim, hidden))
        self.fc_mu = nn.Linear(hidden // 4, action_dim)
        self.fc_logstd = nn.Linear(hidden // 4, action_dim)
        for layer in (self.fc_mu, self.fc_logstd):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.register_buffer("action_scale", ((action_high - action_low) / 2.0).float())
        self.register_buffer("action_bias", ((action_high + action_low) / 2.0).float())

    def forward(self, x):
        x = self.net(x)
        mean = self.fc_mu(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (log_std + 1)
        return mean, log_std

    def get_action(self, x, eps=None):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample() if eps is None else mean + std * eps  # reparameterisation trick
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(1 - y_t.pow(2) + 1e-6)
        log_prob -= torch.log(self.action_scale + 1e-6)
        return action, log_prob.sum(1)


class DistributionalQNetwork(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden, num_atoms, v_min, v_max):
        super().__init__()
        self.net = nn.Sequential(*layer_norm_mlp(obs_dim + action_dim, hidden), nn.Linear(hidden // 4, num_atoms))
        self.v_min, self.v_max, self.num_atoms = v_min, v_max, num_atoms

    def forward(self, obs, actions):
        return self.net(torch.cat([obs, actions], 1))

    def projection(self, obs, actions, rewards, bootstrap, discount, q_support):
        delta_z = (self.v_max - self.v_min) / (self.num_atoms - 1)
        batch_size = rewards.shape[0]
        target_z = rewards.unsqueeze(1) + bootstrap.unsqueeze(1) * discount.unsqueeze(1) * q_support
        target_z = target_z.clamp(self.v_min, self.v_max)
        b = ((target_z - self.v_min) / delta_z).clamp(0, self.num_atoms - 1)
        l = torch.floor(b).long()  # noqa: E741
        u = torch.ceil(b).long()
        next_dist = F.softmax(self.forward(obs, actions), dim=1)
        proj_dist = torch.zeros_like(next_dist)
        offset = (torch.linspace(0, (batch_size - 1) * self.num_atoms, batch_size)
                  .unsqueeze(1).expand(batch_size, self.num_atoms).long())
        # (l == u): b hit an atom exactly -> all the mass goes to it (CleanRL C51)
        proj_dist.view(-1).index_add_(0, (l + offset).view(-1),
                                      (next_dist * (u.float() - b + (l == u).float())).view(-1))
        proj_dist.view(-1).index_add_(0, (u + offset).view(-1), (next_dist * (b - l.float())).view(-1))
        return proj_dist


class Critic(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden, num_q=2, num_atoms=101, v_min=-20.0, v_max=20.0):
        super().__init__()
        self.qnets = nn.ModuleList(
            [DistributionalQNetwork(obs_dim, action_dim, hidden, num_atoms, v_min, v_max) for _ in range(num_q)])
        self.register_buffer("q_support", torch.linspace(v_min, v_max, num_atoms))

    def forward(self, obs, actions):
        return torch.stack([q(obs, actions) for q in self.qnets])  # [num_q, B, atoms]

    def projection(self, obs, actions, rewards, bootstrap, discount):
        return torch.stack([q.projection(obs, actions, rewards, bootstrap, discount, self.q_support)
                            for q in self.qnets])

    def get_value(self, probs):
        return torch.sum(probs * self.q_support, dim=-1)


# -- data parallel: holosoma's gradient all-reduce ---------------------------------------------------

GROUP = None  # the process group to average over (None: the world, as holosoma does); set by the benchmark


def allreduce_grads(params) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(GROUP) == 1:
        return
    params = [p for p in params if p.grad is not None]
    flat = torch.cat([p.grad.view(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=GROUP)
    flat /= dist.get_world_size(GROUP)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


# -- learner -----------------------------------------------------------------------------------------

class CleanRLStyleSAC:
    """Networks, optimisers and the update step; hyper-parameters from an hpcrl ``SACConfig`` (duck-typed)."""

    def __init__(self, cfg, obs_dim, action_dim, action_low, action_high):
        self.cfg = cfg
        self.actor = Actor(obs_dim, action_dim, cfg.actor_hidden, action_low, action_high,
                           cfg.log_std_min, cfg.log_std_max)
        self.qnet = Critic(obs_dim, action_dim, cfg.critic_hidden, cfg.num_q, cfg.num_atoms, cfg.v_min, cfg.v_max)
        self.qnet_target = Critic(obs_dim, action_dim, cfg.critic_hidden, cfg.num_q, cfg.num_atoms, cfg.v_min,
                                  cfg.v_max)
        self.qnet_target.load_state_dict(self.qnet.state_dict())
        self.log_alpha = torch.tensor([math.log(cfg.alpha_init)], requires_grad=True)
        self.target_entropy = -cfg.target_entropy_ratio * action_dim
        self.q_optimizer = torch.optim.AdamW(self.qnet.parameters(), lr=cfg.critic_lr, betas=(0.9, 0.95),
                                             weight_decay=cfg.weight_decay)
        self.actor_optimizer = torch.optim.AdamW(self.actor.parameters(), lr=cfg.actor_lr, betas=(0.9, 0.95),
                                                 weight_decay=cfg.weight_decay)
        self.a_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr, betas=(0.9, 0.95))
        self.critic_steps = 0

    def update(self, data: ReplayBufferSamples, noise=None) -> dict[str, float]:
        """One critic + alpha step, the Polyak update, and the actor step every ``policy_frequency``.

        ``noise``: optional ``(next_eps, actor_eps)`` standard-normal draws (for the equivalence check).
        """
        cfg = self.cfg
        next_eps, actor_eps = noise if noise is not None else (None, None)
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_actions, next_log_pi = self.actor.get_action(data.next_observations, next_eps)
            bootstrap = 1.0 - data.dones
            discount = torch.full_like(data.rewards, cfg.gamma)
            soft_rewards = data.rewards - discount * bootstrap * alpha * next_log_pi
            target_dist = self.qnet_target.projection(data.next_observations, next_actions, soft_rewards,
                                                      bootstrap, discount)
        qf_logits = self.qnet(data.observations, data.actions)
        qf_loss = 0.0
        for k in range(qf_logits.shape[0]):
            qf_loss = qf_loss + (-torch.sum(target_dist[k] * F.log_softmax(qf_logits[k], dim=1), dim=1)).mean()
        self.q_optimizer.zero_grad()
        qf_loss.backward()
        allreduce_grads(self.qnet.parameters())
        self.q_optimizer.step()

        alpha_loss = (-self.log_alpha.exp() * (next_log_pi + self.target_entropy)).mean()
        if cfg.autotune_alpha:
            self.a_optimizer.zero_grad()
            alpha_loss.backward()
            allreduce_grads([self.log_alpha])
            self.a_optimizer.step()

        for param, target_param in zip(self.qnet.parameters(), self.qnet_target.parameters()):
            target_param.data.copy_(cfg.tau * param.data + (1 - cfg.tau) * target_param.data)
        self.critic_steps += 1
        out = {"critic_loss": qf_loss.detach(), "alpha_loss": alpha_loss.detach()}

        if self.critic_steps % cfg.policy_frequency == 0:
            pi, log_pi = self.actor.get_action(data.observations, actor_eps)
            q = self.qnet.get_value(F.softmax(self.qnet(data.observations, pi), dim=-1)).mean(0)
            actor_loss = (alpha * log_pi - q).mean()
            self.actor_optimizer.zero_grad()
            actor_loss.backward()
            allreduce_grads(self.actor.parameters())
            self.actor_optimizer.step()
            out["actor_loss"] = actor_loss.detach()
        return out

    # -- for the equivalence check ---------------------------------------------------------------------
    @torch.no_grad()
    def load_from_hpcrl(self, agent) -> None:
        """Copy parameters from an ``hpcrl.sac.FastSAC`` (same architecture, same parameter order)."""
        pairs = [(self.actor, agent.actor), (self.qnet, agent.critic), (self.qnet_target, agent.critic_target)]
        for mine, theirs in pairs:
            a, b = list(mine.parameters()), list(theirs.parameters())
            assert len(a) == len(b), (len(a), len(b))
            for p, q in zip(a, b):
                assert p.shape == q.shape, (p.shape, q.shape)
                p.copy_(q)
        self.log_alpha.copy_(agent.log_alpha.detach().reshape(1))


# -- the training loop -------------------------------------------------------------------------------

class CleanRLStyleLoop:
    """hpcrl.sac's loop (normaliser update, act, env step, replay add, episode returns, updates) written
    CleanRL style: numpy replay, per-env return bookkeeping in numpy. ``step()`` is one vector env step;
    the returns of the episodes it finished are appended to ``finished``."""

    def __init__(self, cfg, env, seed: int = 0):
        self.cfg, self.env = cfg, env
        torch.manual_seed(seed)
        self.agent = CleanRLStyleSAC(cfg, env.obs_dim, env.action_dim, env.action_low, env.action_high)
        self.norm = EmpiricalNormalization(env.obs_dim)
        self.rb = ReplayBuffer(cfg.buffer_size, cfg.num_envs, env.obs_dim, env.action_dim, seed=seed)
        self.returns = np.zeros(cfg.num_envs, dtype=np.float64)
        self.finished: list[float] = []
        self.obs = env.reset(seed=seed)
        self.it = self.updates = 0

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        return self.norm(obs) if self.cfg.obs_normalization else obs

    def step(self) -> None:
        cfg, env = self.cfg, self.env
        if cfg.obs_normalization:
            self.norm.update(self.obs)
        if self.it < cfg.random_steps:
            low, high = env.action_low, env.action_high
            action = low + (high - low) * torch.rand(cfg.num_envs, env.action_dim)
        else:
            with torch.no_grad():
                action, _ = self.agent.actor.get_action(self.normalize(self.obs))
        result = env.step(action)
        reward = result.reward.numpy().astype(np.float64)
        self.rb.add(self.obs.numpy(), result.next_obs.numpy(), action.numpy(), reward * cfg.reward_scale,
                    result.terminated.numpy())
        self.returns += reward
        done = (result.terminated | result.truncated).numpy()
        if done.any():
            self.finished.extend(self.returns[done].tolist())
            self.returns[done] = 0.0
        self.obs = result.obs
        if self.it >= cfg.learning_starts:
            for _ in range(cfg.num_updates):
                data = self.rb.sample(cfg.batch_size)
                data = data._replace(observations=self.normalize(data.observations),
                                     next_observations=self.normalize(data.next_observations))
                self.agent.update(data)
                self.updates += 1
        self.it += 1
