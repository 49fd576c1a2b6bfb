"""FastSAC learner state: networks, optimisers and gradient averaging of one rank, and its update: critic+alpha
every step, actor every ``policy_frequency`` critic steps, Polyak target after every critic step. The update
itself is hpcrl/sac/update.py's, stepped eagerly (hpcrl/sac/eager.py) or captured (``--compile``,
hpcrl/sac/compiled.py).

All randomness of an update comes in through :class:`UpdateNoise`, so W ranks can be checked
against one rank fed the concatenated batches and noise (tests/test_sac_dp.py).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from hpcrl.comm import GradAverager, Plane
from hpcrl.replay import Batch

from .compiled import CompiledUpdate
from .config import SACConfig
from .eager import EagerSteps
from .flat import optimizer_state_in, optimizer_state_out
from .networks import Actor, BatchedCritic, DistributionalCritic
from .params import ParamLayout
from .update import Data, Objective, run_update


def amp_mode(cfg: SACConfig) -> str:
    """The effective ``--amp`` ("none", "bf16", "fp16"): the old ``--bf16`` flag means ``--amp bf16``."""
    return "bf16" if cfg.amp == "none" and cfg.bf16 else cfg.amp


def mirror_batch(batch: Batch, mirror_obs, mirror_action, mirror_critic_obs=None) -> Batch:
    """``[batch; mirrored batch]``: twice the rows, the second half mirrored (obs, next obs, critic
    obs, actions); rewards, discounts and n repeat (a mirrored transition has the same reward)."""
    def both(x, f):
        return None if x is None else torch.cat([x, f(x)])

    same = lambda x: x  # noqa: E731
    return Batch(both(batch.obs, mirror_obs), both(batch.action, mirror_action), both(batch.reward, same),
                 both(batch.next_obs, mirror_obs), both(batch.discount, same), both(batch.n, same),
                 both(batch.critic_obs, mirror_critic_obs), both(batch.next_critic_obs, mirror_critic_obs))


class UpdateNoise(NamedTuple):
    next_eps: torch.Tensor  # [B, A] noise of a' ~ pi(.|s') in the critic target
    actor_eps: torch.Tensor  # [B, A] noise of a ~ pi(.|s) in the actor loss

    @staticmethod
    def draw(batch: int, action_dim: int, generator: torch.Generator, device: torch.device) -> "UpdateNoise":
        eps = torch.randn(2, batch, action_dim, generator=generator, device=device)
        return UpdateNoise(eps[0], eps[1])


@dataclass
class Counters:
    vector_steps: int = 0  # steps of all envs at once (each = num_envs transitions globally)
    critic_steps: int = 0
    actor_steps: int = 0


class FastSAC(nn.Module):
    """Networks, optimisers and gradient averaging of one rank."""

    def __init__(self, cfg: SACConfig, obs_dim: int, action_dim: int, action_low: torch.Tensor,
                 action_high: torch.Tensor, device: torch.device, *, plane: Plane,
                 critic_obs_dim: int | None = None) -> None:
        """``plane``: the device plane gradients are averaged over (``ctx.device_plane``; a plane of
        one, ``Plane.local("device", device)``, for a single process). ``critic_obs_dim``: width of the
        env's privileged critic observation (the critic and its target read it instead of the actor's
        observation); None = the critic reads the actor's observation."""
        super().__init__()
        self.cfg = cfg
        self.action_dim = action_dim
        self.actor = Actor(obs_dim, action_dim, cfg.actor_hidden, action_low, action_high, cfg.layer_norm,
                           cfg.log_std_min, cfg.log_std_max).to(device)
        critic_cls = BatchedCritic if cfg.batched_critic else DistributionalCritic
        self.critic = critic_cls(critic_obs_dim or obs_dim, action_dim, cfg.critic_hidden, cfg.num_q, cfg.num_atoms,
                                 cfg.v_min, cfg.v_max, cfg.layer_norm).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(cfg.alpha_init), device=device).log())
        # DDP reduces its own gradient buckets: it keeps per-parameter tensors.
        self.layout = ParamLayout(self.critic, self.actor, self.critic_target, self.log_alpha,
                                  flat=cfg.flat_params and cfg.grad_average != "ddp")
        # fused: one kernel for all parameters (CPU and CUDA) instead of a dozen ops per tensor.
        adamw = dict(betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True)
        self.critic_opt = torch.optim.AdamW(self.layout.critic, lr=cfg.critic_lr, **adamw)
        self.actor_opt = torch.optim.AdamW(self.layout.actor, lr=cfg.actor_lr, **adamw)
        # Plain Adam: holosoma's AdamW default weight decay 1e-2 silently pulls log(alpha) to 0.
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr, betas=(0.9, 0.95), fused=True)
        self.critic_average, self.actor_average = self._averagers(plane)
        self.counters = Counters()
        amp = amp_mode(cfg)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
                    if amp != "none" else contextlib.nullcontext())
        self.objective = Objective(self.critic.support, self.critic.q_value, -cfg.target_entropy_ratio * action_dim,
                                   cfg.cdq, autocast)
        # fp16 only: bf16 has fp32's range (holosoma's scaler under bf16 is overhead, docs/holosoma.md).
        # One scaler for the critic (+alpha) and the actor steps, updated after each, as holosoma does.
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        self.eager = EagerSteps(self)
        # --compile: the same update captured (hpcrl/sac/compiled.py); eager stays the default.
        self.compiled = CompiledUpdate(self) if cfg.compile else None

    def _averagers(self, plane: Plane) -> tuple[GradAverager, GradAverager]:
        """One collective per optimizer update: critic + log-alpha together, the actor alone."""
        cfg, layout = self.cfg, self.layout
        # Captured (--compile): gradients come out of one graph, nothing to overlap with.
        overlap = cfg.overlap_grad_average and (layout.flat or cfg.grad_average == "view") and not cfg.compile
        averagers = tuple(GradAverager(params, cfg.grad_average, plane=plane, grad_buffers=buffers, overlap=overlap,
                                       timeout_s=float(cfg.timeout_s))
                          for params, buffers in ((layout.critic_grads, layout.critic_buffers),
                                                  (layout.actor_grads, layout.actor_buffers)))
        for averager in averagers:
            averager.zero_grad()
        return averagers

    @property
    def flat(self) -> bool:
        """Each model's parameters and gradients in one flat buffer (else per-parameter tensors)."""
        return self.layout.flat

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp().detach()

    def update(self, batch: Batch, noise: UpdateNoise) -> dict[str, torch.Tensor]:
        """One critic (+alpha) step, the target update, and the actor step when it is due.

        Returns detached scalar tensors (no host read) for logging.
        """
        actor_due = (self.counters.critic_steps + 1) % self.cfg.policy_frequency == 0
        data = Data.of(batch, noise)
        if self.compiled is not None:
            out = self.compiled.update(data, actor_due)
        else:
            out = run_update(self.eager, None, data, actor_due)
        self.counters.critic_steps += 1
        self.counters.actor_steps += int(actor_due)
        if self.scaler is not None:
            out["grad_scale"] = self.scaler._scale.detach().clone()  # a device tensor; get_scale() reads the device
        return out

    # -- state -------------------------------------------------------------------------------------

    def learner_state(self) -> dict:
        return {
            "actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(), "log_alpha": self.log_alpha.detach().clone(),
            # per-parameter optimizer state in the per-head critic's order, whatever the layout here
            "critic_opt": optimizer_state_out(self.critic_opt.state_dict(), self.layout.reshapes["critic"]),
            "actor_opt": optimizer_state_out(self.actor_opt.state_dict(), self.layout.reshapes["actor"]),
            "alpha_opt": self.alpha_opt.state_dict(),
            "counters": [self.counters.vector_steps, self.counters.critic_steps, self.counters.actor_steps],
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_learner_state(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.critic_opt.load_state_dict(optimizer_state_in(state["critic_opt"], self.layout.reshapes["critic"]))
        self.actor_opt.load_state_dict(optimizer_state_in(state["actor_opt"], self.layout.reshapes["actor"]))
        self.alpha_opt.load_state_dict(state["alpha_opt"])
        self.counters = Counters(*[int(x) for x in state["counters"]])
        if self.scaler is not None and "scaler" in state:  # --amp fp16 resumed from an fp16 checkpoint
            self.scaler.load_state_dict(state["scaler"])

    def broadcast_tensors(self) -> list[torch.Tensor]:
        """Everything rank 0 broadcasts at start-up and after a resume (flat: three buffers)."""
        if self.flat:
            critic, actor, target = self.layout.flats()
            return [*actor.buffers.values(), *critic.buffers.values(), *target.buffers.values()]
        return [*self.actor.parameters(), *self.critic.parameters(), *self.critic_target.parameters(),
                self.log_alpha]
