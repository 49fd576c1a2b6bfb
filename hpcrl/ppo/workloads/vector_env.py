"""Vector-env PPO on :mod:`hpcrl.envs`: the :class:`~hpcrl.ppo.workload.Workload` for CartPole-style
discrete tasks and continuous ones (swing-up, Pendulum).

Model: separate actor and critic MLPs (tanh, orthogonal init as SB3/CleanRL: hidden gain sqrt(2),
policy head 0.01, value head 1); a Categorical head for discrete envs, a Gaussian with a
state-independent log-std for continuous ones. Actions are clipped to the env's bounds only on their
way into the env; the unclipped action is what is shipped and scored (its log-prob is the density
that actually produced it).

Experience batch (one :meth:`VectorEnvCollector.collect`, ``T = rollout_len``, ``N = num_envs``,
``D = obs_dim``, ``A = action_dim``), all on the collector's device:

==================  ==========  =========  ==================================================
key                 shape       dtype      meaning
==================  ==========  =========  ==================================================
``obs``             [T, N, D]   float32    observation acted on
``next_obs``        [T, N, D]   float32    observation that truly followed (the final one where
                                           the episode ended, not the auto-reset one)
``actions``         [T, N]      int64      discrete; [T, N, A] float32 (unclipped) if continuous
``behaviour_logp``  [T, N]      float32    log pi_maker(action | obs)
``rewards``         [T, N]      float32
``terminated``      [T, N]      float32    1 at a terminal state (no bootstrap)
``dones``           [T, N]      float32    1 where the episode ended (terminated or truncated)
==================  ==========  =========  ==================================================

No values or advantages travel: the learner computes them with its current critic (docs/coati.md, "Defects of coati/ray that hpcrl addresses"), from
``V(obs)`` and ``V(next_obs)``. ``next_obs`` equals ``obs[t + 1]`` except at episode ends and the last
step, so it costs what a fixed-shape "final obs where done" field plus the last obs would, and GAE
needs no stitching.

Learner options in ``PPOConfig.extra`` (other keys are ignored; on the command line ``--ppo.anneal-updates``
and ``--ppo.adam-eps``):

* ``anneal_updates`` (int, default 0 = off): learning rate and clip coefficient decay linearly
  to 0 over this many :meth:`VectorEnvLearner.update` calls; update ``k`` (counting from 0) uses
  ``max(0, 1 - k / anneal_updates)`` times the configured values (SB3's ``lin_<x>`` schedules).
  :meth:`VectorEnvWorkload.default_config` sets it to 100k env steps' worth of single-batch updates.
* ``adam_eps`` (float, default 1e-5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError
from hpcrl.envs import EpisodeStats, make_env

from ..losses import gae, lr_at, whiten
from ..update import Coefs, GradStep, Outputs, Plan, Samples, ppo_update, read_stats
from ..workload import Collector, Learner, PPOConfig, Workload

__all__ = ["ActorCritic", "VectorEnvCollector", "VectorEnvLearner", "VectorEnvWorkload"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _mlp(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_dim, hidden, device="meta"),
        nn.Tanh(),
        nn.Linear(hidden, hidden, device="meta"),
        nn.Tanh(),
        nn.Linear(hidden, out_dim, device="meta"),
    )


def _init_mlp(net: nn.Sequential, out_gain: float, generator: torch.Generator) -> None:
    linears = [m for m in net if isinstance(m, nn.Linear)]
    for i, layer in enumerate(linears):
        gain = out_gain if i == len(linears) - 1 else math.sqrt(2.0)
        nn.init.orthogonal_(layer.weight, gain=gain, generator=generator)
        nn.init.zeros_(layer.bias)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs. ``num_actions`` set: Categorical policy; else a Gaussian over
    ``action_dim`` dimensions with a learned state-independent ``log_std``.

    Initialised from ``seed`` alone (built on the meta device, then every parameter written from a
    local generator), so every rank builds the same model and the global RNG is not touched.
    """

    def __init__(
        self,
        obs_dim: int,
        hidden: int,
        *,
        num_actions: int | None = None,
        action_dim: int | None = None,
        init_log_std: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if (num_actions is None) == (action_dim is None):
            raise ValueError("give exactly one of num_actions (discrete) and action_dim (continuous)")
        self.discrete = num_actions is not None
        out_dim = num_actions if self.discrete else action_dim
        self.actor = _mlp(obs_dim, hidden, out_dim)
        self.critic = _mlp(obs_dim, hidden, 1)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.empty(action_dim, device="meta"))
        self.to_empty(device="cpu")
        g = torch.Generator().manual_seed(int(seed))
        _init_mlp(self.actor, 0.01, g)
        _init_mlp(self.critic, 1.0, g)
        if not self.discrete:
            nn.init.constant_(self.log_std, init_log_std)

    def value(self, obs: Tensor) -> Tensor:
        """V(obs): [..., D] -> [...]."""
        return self.critic(obs).squeeze(-1)

    def log_prob_entropy(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        """log pi(actions | obs) and the policy's entropy at obs, both [...]."""
        out = self.actor(obs)
        if self.discrete:
            logp_all = torch.log_softmax(out, dim=-1)
            logp = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp, entropy
        z = (actions - out) * torch.exp(-self.log_std)
        logp = (-0.5 * z.square() - self.log_std - _LOG_SQRT_2PI).sum(-1)
        entropy = (self.log_std + 0.5 + _LOG_SQRT_2PI).sum().expand(logp.shape)
        return logp, entropy

    @torch.no_grad()
    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Sample actions for obs [N, D] and return (actions, their log-probs [N]).

        The noise is drawn on ``generator``'s device (the seed discipline uses CPU generators) and
        moved: ``torch.distributions`` samplers accept no generator. Discrete: inverse-CDF of one
        uniform per env. Continuous: ``mean + std * eps``, unclipped.
        """
        out = self.actor(obs)
        n = obs.shape[0]
        if self.discrete:
            u = torch.rand(n, 1, generator=generator, device=generator.device).to(obs.device, out.dtype)
            cdf = torch.softmax(out, dim=-1).cumsum(-1)
            # Rounding can leave cdf[-1] a hair below u: clamp to the last action.
            actions = (cdf < u).sum(-1).clamp_(max=out.shape[-1] - 1)
        else:
            eps = torch.randn(out.shape, generator=generator, device=generator.device).to(obs.device, out.dtype)
            actions = out + torch.exp(self.log_std) * eps
        return actions, self.log_prob_entropy(obs, actions)[0]


@dataclass
class VectorEnvWorkload(Workload):
    """PPO on ``make_env(env, num_envs, device, seed=rank_seed, **env_kwargs)``.

    ``init_log_std`` is the Gaussian's initial log-std (continuous envs only; action units).
    """

    env: str = "cartpole"
    num_envs: int = 8
    rollout_len: int = 32
    hidden: int = 64
    init_log_std: float = 0.0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.env
        # One throwaway env on CPU gives the spec (obs/action sizes, bounds) without a device.
        probe = make_env(self.env, 1, "cpu", seed=0, **self.env_kwargs)
        self.obs_dim = probe.obs_dim
        self.num_actions = probe.num_actions
        self.action_dim = probe.action_dim
        probe.close()

    @property
    def samples_per_batch(self) -> int:
        return self.num_envs * self.rollout_len

    def default_config(self) -> PPOConfig:
        """Discrete envs: SB3-zoo CartPole hyper-parameters (docs/envs.md#hyper-parameter-sources), with lr and clip
        annealed to 0 over 100k env steps of single-batch updates (scale ``extra["anneal_updates"]``
        if each update consumes several batches). Continuous envs: 5 epochs x 4 minibatches,
        lr 1e-3, gamma 0.99, lambda 0.95, no annealing (measured on swing-up, 16 envs x 64 steps:
        episode return of the initial policy 20-30, after 16k env steps 55-210 depending on the
        seed)."""
        # vf_coef 1 on our 0.5 * MSE equals SB3's vf_coef 0.5 on its plain MSE.
        common = dict(clip_coef=0.2, value_clip_coef=None, ent_coef=0.0, vf_coef=1.0, max_grad_norm=0.5)
        if self.num_actions is not None:
            return PPOConfig(epochs=20, minibatches=1, lr=1e-3, gamma=0.98, gae_lambda=0.8, **common,
                             extra={"anneal_updates": 100_000 // self.samples_per_batch})
        return PPOConfig(epochs=5, minibatches=4, lr=1e-3, gamma=0.99, gae_lambda=0.95, **common)

    def build_model(self, seed: int, device: torch.device) -> ActorCritic:
        model = ActorCritic(
            self.obs_dim,
            self.hidden,
            num_actions=self.num_actions,
            action_dim=self.action_dim,
            init_log_std=self.init_log_std,
            seed=seed,
        )
        return model.to(device)

    def publish_tensors(self, model: nn.Module) -> list[Tensor]:
        return [p.detach() for p in model.parameters()]

    def make_collector(self, rank_seed: int, device: torch.device) -> VectorEnvCollector:
        return VectorEnvCollector(self, rank_seed, device)

    def make_learner(self, model: nn.Module, cfg: PPOConfig, grad_average: Any) -> VectorEnvLearner:
        return VectorEnvLearner(model, cfg, grad_average)


class VectorEnvCollector(Collector):
    """Maker side: the envs, their current observations and running episode statistics."""

    def __init__(self, spec: VectorEnvWorkload, rank_seed: int, device: torch.device | str) -> None:
        self.rollout_len = spec.rollout_len
        self.env = make_env(spec.env, spec.num_envs, device, seed=rank_seed, **spec.env_kwargs)
        self.obs = self.env.reset()
        self.episodes = EpisodeStats(spec.num_envs, self.env.device)

    def _clip(self, actions: Tensor) -> Tensor:
        if self.env.is_discrete:
            return actions
        return torch.maximum(torch.minimum(actions, self.env.action_high), self.env.action_low)

    def collect(self, model: nn.Module, generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, float]]:
        steps: list[tuple[Tensor, ...]] = []
        for _ in range(self.rollout_len):
            obs = self.obs
            actions, logp = model.act(obs, generator)
            res = self.env.step(self._clip(actions))
            self.episodes.update(res)
            steps.append((obs, res.next_obs, actions, logp, res.reward, res.terminated, res.done))
            self.obs = res.obs
        obs, next_obs, actions, logp, rewards, terminated, dones = (torch.stack(x) for x in zip(*steps))
        batch = {
            "obs": obs.float(),
            "next_obs": next_obs.float(),
            "actions": actions if self.env.is_discrete else actions.float(),
            "behaviour_logp": logp.float(),
            "rewards": rewards.float(),
            "terminated": terminated.float(),
            "dones": dones.float(),
        }
        ep = self.episodes.pop().as_tensor().tolist()  # one host read per rollout
        stats = {
            "episode_return_sum": ep[0],
            "episode_length_sum": ep[1],
            "episodes": ep[2],
            "env_steps": float(self.rollout_len * self.env.num_envs),
        }
        return batch, stats

    def state_dict(self) -> dict[str, Any]:
        return {"env": self.env.state_dict(), "obs": self.obs.clone(), "episodes": self.episodes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env.load_state_dict(state["env"])
        self.obs = state["obs"].to(self.env.device).clone()
        self.episodes.load_state_dict(state["episodes"])


def _explained_variance(pred: Tensor, target: Tensor) -> Tensor:
    """1 - Var(target - pred) / Var(target): 1 is a perfect critic, <= 0 no better than a constant."""
    return 1.0 - (target - pred).var() / target.var().clamp_min(1e-8)


class VectorEnvLearner(Learner):
    """Trainer side: Adam over the whole model, PPO epochs x minibatches on the concatenated batches
    (concatenated along the env axis, so GAE runs once over [T, sum N]).

    Per update: values, GAE and (with ``cfg.truncated_is``) the proximal log-probs come from the
    model as it is at the start of the update; advantages are whitened once over the whole batch.
    Each minibatch step (:func:`hpcrl.ppo.update.ppo_update`): backward -> ``grad_average.all_reduce()``
    -> clip the global grad norm -> step.
    """

    def __init__(self, model: nn.Module, cfg: PPOConfig, grad_average: Any) -> None:
        self.model, self.cfg, self.grad_average = model, cfg, grad_average
        self.anneal_updates = int(cfg.extra.get("anneal_updates", 0))
        if self.anneal_updates < 0:
            raise ValueError(f"extra['anneal_updates'] must be >= 0, got {self.anneal_updates}")
        if cfg.epochs < 1 or cfg.minibatches < 1:
            raise ValueError(f"epochs and minibatches must be >= 1, got {cfg.epochs}, {cfg.minibatches}")
        for flag, given in (("advantage", cfg.advantage != "grpo"), ("kl-target", cfg.kl_target is not None)):
            if given:
                raise ConfigError(f"--ppo.{flag}: applies to the token workloads (--workload hf / lm), not a vector "
                                  "env (GAE advantages, no reference model); drop it")
        if self.anneal_updates and (cfg.lr_schedule != "constant" or cfg.warmup_updates):
            raise ConfigError("--ppo.anneal-updates with --ppo.lr-schedule / --ppo.warmup-updates: two learning-rate "
                              "schedules; keep one (--ppo.anneal-updates 0 for warm-up / cosine)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Fused Adam: one kernel instead of ~40 small ops per step, 4x faster for these tiny nets.
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in self.params)
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, eps=float(cfg.extra.get("adam_eps", 1e-5)),
                                          fused=fused or None)
        self.updates = 0

    def schedule(self) -> float:
        """Multiplier of lr and clip coefficient for the next update (1 without annealing)."""
        if self.anneal_updates == 0:
            return 1.0
        return max(0.0, 1.0 - self.updates / self.anneal_updates)

    def update(self, batches: list[dict[str, Tensor]], generator: torch.Generator) -> dict[str, float]:
        cfg, model = self.cfg, self.model
        device = self.params[0].device  # experience may arrive on another device (e.g. CPU over gloo)
        batch = {k: torch.cat([b[k] for b in batches], dim=1).to(device) for k in batches[0]}
        samples = self._samples(batch)
        obs, actions = batch["obs"].flatten(0, 1), batch["actions"].flatten(0, 1)  # [T * N, ...] samples

        def forward(idx: Tensor) -> Outputs:
            logp, entropy = model.log_prob_entropy(obs[idx], actions[idx])
            return Outputs(logp, entropy, model.value(obs[idx]))

        frac = self.schedule()
        clip_coef = cfg.clip_coef * frac
        lr = lr_at(self.updates, cfg.lr * frac, cfg.lr_schedule, cfg.warmup_updates, cfg.decay_updates,
                   cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        step = GradStep(self.optimizer, self.params, self.grad_average, cfg.max_grad_norm)
        stats = ppo_update(forward, samples, Coefs.of(cfg, clip=clip_coef),
                           Plan(cfg.epochs, cfg.minibatches, "tensor_split"), step, generator)
        self.updates += 1
        stats["explained_variance"] = _explained_variance(samples.old_values, samples.returns)
        n = samples.advantages.numel()
        return {**read_stats(stats), "lr": lr, "clip_coef": clip_coef, "samples": float(n)}

    def _samples(self, batch: dict[str, Tensor]) -> Samples:
        """Values, GAE and (with ``cfg.truncated_is``) the proximal log-probs from the model as it is
        at the start of the update, flattened to ``[T * N]`` samples; advantages whitened once."""
        cfg, model = self.cfg, self.model
        with torch.no_grad():
            values = model.value(batch["obs"])
            next_values = model.value(batch["next_obs"])
            adv, returns = gae(batch["rewards"], values, next_values, batch["terminated"], batch["dones"],
                               cfg.gamma, cfg.gae_lambda)
            proximal = None
            if cfg.truncated_is is not None:
                proximal = model.log_prob_entropy(batch["obs"], batch["actions"])[0].flatten()
            if cfg.normalize_advantages:
                adv = whiten(adv)
        return Samples(batch["behaviour_logp"].flatten(0, 1), adv.flatten(), values.flatten(), returns.flatten(),
                       proximal)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and update counter (the schedule's position): all a trainer resumes from."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])

