"""FastSAC learner state and its update step: critic+alpha every step, actor every
``policy_frequency`` critic steps, Polyak target after every critic step.

All randomness of an update comes in through :class:`UpdateNoise`, so W ranks can be checked
against one rank fed the concatenated batches and noise (tests/test_sac_dp.py).

Order of one optimizer update (holosoma's, docs/holosoma.md#data-parallelism): backward (of the loss
times the GradScaler's scale under ``--amp fp16``) -> all-reduce of the (scaled) gradients on the
device plane -> ``unscale_`` -> clip to ``max_grad_norm`` -> step (skipped under fp16 when a gradient
is inf/NaN). Every rank holds the same reduced gradients after the all-reduce, so clipping, the
inf check and the skip are identical on every rank by construction: an inf on one rank becomes an
inf in everybody's sum.
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

from . import losses
from .compiled import CompiledUpdate
from .config import SACConfig
from .flat import FlatParams, Reshape, optimizer_state_in, optimizer_state_out
from .networks import Actor, BatchedCritic, DistributionalCritic


def amp_mode(cfg: SACConfig) -> str:
    """The effective ``--amp`` ("none", "bf16", "fp16"): the old ``--bf16`` flag means ``--amp bf16``."""
    amp = getattr(cfg, "amp", "none")
    return "bf16" if amp == "none" and cfg.bf16 else amp


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
    iteration: int = 0  # env steps of the vector env (each = num_envs transitions globally)
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
        self.critic_obs_dim = critic_obs_dim
        self.actor = Actor(obs_dim, action_dim, cfg.actor_hidden, action_low, action_high, cfg.layer_norm,
                           cfg.log_std_min, cfg.log_std_max).to(device)
        critic_cls = BatchedCritic if getattr(cfg, "batched_critic", False) else DistributionalCritic
        self.critic = critic_cls(critic_obs_dim or obs_dim, action_dim, cfg.critic_hidden, cfg.num_q, cfg.num_atoms,
                                 cfg.v_min, cfg.v_max, cfg.layer_norm).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(cfg.alpha_init), device=device).log())
        self.target_entropy = -cfg.target_entropy_ratio * action_dim
        # DDP reduces its own gradient buckets: it keeps per-parameter tensors.
        self.flat = bool(getattr(cfg, "flat_params", True)) and cfg.grad_average != "ddp"
        self._layout_params(plane)
        # fused: one kernel for all parameters (CPU and CUDA) instead of a dozen ops per tensor.
        adamw = dict(betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True)
        self.critic_opt = torch.optim.AdamW(self._online_params, lr=cfg.critic_lr, **adamw)
        self.actor_opt = torch.optim.AdamW(self._actor_params, lr=cfg.actor_lr, **adamw)
        # Plain Adam: holosoma's AdamW default weight decay 1e-2 silently pulls log(alpha) to 0.
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr, betas=(0.9, 0.95), fused=True)
        self.critic_train = self.critic_average.wrap(self.critic)
        self.actor_train = self.actor_average.wrap(self.actor)
        self.counters = Counters()
        self.amp = amp_mode(cfg)
        self._autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if self.amp == "bf16" else torch.float16)
                          if self.amp != "none" else contextlib.nullcontext())
        # fp16 only: bf16 has fp32's range (holosoma's scaler under bf16 is overhead, docs/holosoma.md).
        # One scaler for the critic (+alpha) and the actor steps, updated after each, as holosoma does.
        self.scaler = torch.amp.GradScaler(device.type) if self.amp == "fp16" else None
        self.max_grad_norm = float(getattr(cfg, "max_grad_norm", 0.0))
        for averager in (self.critic_average, self.actor_average):
            averager.zero_grad()
        # --compile: the whole update captured (hpcrl/sac/compiled.py); the eager path below stays the default.
        self._compiled = CompiledUpdate(self) if getattr(cfg, "compile", False) else None

    def _layout_params(self, plane: Plane) -> None:
        """What the optimizers, the Polyak update and the averagers step: per-parameter tensors, or
        with ``flat`` one alias per model over its flat buffer (critic and log-alpha share one buffer,
        hence one collective; the target has its own, so Polyak is one lerp)."""
        critic_params, actor_params = list(self.critic.parameters()), list(self.actor.parameters())
        mode = self.cfg.grad_average
        self._reshapes: dict[str, list[Reshape]] = {"actor": [], "critic": []}
        if isinstance(self.critic, BatchedCritic):
            heads = self.critic.to_heads(critic_params)
            self._reshapes["critic"].append(Reshape([p.shape for p in critic_params], [h.shape for h in heads],
                                                    self.critic.to_heads, self.critic.from_heads))
        if not self.flat:
            self._online_params, self._actor_params = critic_params, actor_params
            self._target_params = list(self.critic_target.parameters())
            critic_buffers = actor_buffers = None
        else:
            self._flat_critic = FlatParams([*critic_params, self.log_alpha])
            self._flat_actor = FlatParams(actor_params)
            self._flat_target = FlatParams(list(self.critic_target.parameters()), grads=False)
            self._online_params = [self._flat_critic.alias(critic_params)]
            self._actor_params = [self._flat_actor.alias()]
            self._target_params = [self._flat_target.alias()]
            self._reshapes["critic"].insert(0, self._flat_critic.reshape(critic_params))
            self._reshapes["actor"].append(self._flat_actor.reshape())
            critic_buffers = self._flat_critic.grad_buffers.values()
            actor_buffers = self._flat_actor.grad_buffers.values()
        # One collective per optimizer update: critic + log-alpha together, the actor alone.
        overlap = dict(overlap=bool(getattr(self.cfg, "overlap_grad_average", False)) and (self.flat or mode == "view")
                       and not getattr(self.cfg, "compile", False),  # captured: gradients come out of one graph
                       timeout_s=float(getattr(self.cfg, "timeout_s", 300.0)))
        self.critic_average = GradAverager([*critic_params, self.log_alpha], mode, plane=plane,
                                           grad_buffers=critic_buffers, **overlap)
        self.actor_average = GradAverager(actor_params, mode, plane=plane, grad_buffers=actor_buffers, **overlap)

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp().detach()

    def update(self, batch: Batch, noise: UpdateNoise) -> dict[str, torch.Tensor]:
        """One critic (+alpha) step, the target update, and the actor step when it is due.

        Returns detached scalar tensors (no host read) for logging.
        """
        if self._compiled is not None:
            return self._compiled.update(batch, noise)
        cfg = self.cfg
        alpha = self.alpha
        with torch.no_grad(), self._autocast:
            next_action, next_log_prob = self.actor.sample(batch.next_obs, noise.next_eps)
            next_log_prob = next_log_prob.float()
            target_logits = self.critic_target(batch.q_next_obs, next_action)
            reward = losses.soft_reward(batch.reward, batch.discount, alpha, next_log_prob)
            target = losses.target_distribution(target_logits, reward, batch.discount, self.critic.support, cfg.cdq)
        with self._autocast:
            logits = self.critic_train(batch.q_obs, batch.action)
        critic_loss = losses.critic_loss(logits, target)
        alpha_loss = losses.alpha_loss(self.log_alpha, next_log_prob, self.target_entropy)
        self._scaled(critic_loss + alpha_loss).backward()  # disjoint graphs: one backward fills both grads
        self.critic_average.all_reduce()  # of the scaled gradients (fp16), like holosoma
        opts = [self.critic_opt, self.alpha_opt] if cfg.autotune_alpha else [self.critic_opt]
        critic_grad_norm = self._clip_and_step(opts, self._online_params)
        self.critic_average.zero_grad()
        with torch.no_grad():  # flat: one lerp over the target buffer
            torch._foreach_lerp_(self._target_params, self._online_params, cfg.tau)
        self.counters.critic_steps += 1
        out = {"critic_loss": critic_loss.detach(), "alpha_loss": alpha_loss.detach(),
               "critic_grad_norm": critic_grad_norm}

        if self.counters.critic_steps % cfg.policy_frequency == 0:  # i.e. (critic_step + 1) % pf == 0
            out["actor_loss"], out["entropy"], out["actor_grad_norm"] = self._update_actor(
                batch.obs, noise.actor_eps, alpha, batch.q_obs)
        if self.scaler is not None:
            out["grad_scale"] = self.scaler._scale.detach().clone()  # a device tensor; get_scale() reads the device
        return out

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def _clip_and_step(self, opts: list[torch.optim.Optimizer], params: list[torch.Tensor]) -> torch.Tensor:
        """unscale_ (fp16) -> clip -> step -> scaler.update, on gradients already all-reduced. Returns
        the (unscaled, pre-clip) gradient norm of ``params`` as a tensor (no host read). With the scaler
        the step of a fused optimizer takes the found-inf flag on the device (no host read either)."""
        if self.scaler is not None:
            for opt in opts:
                self.scaler.unscale_(opt)
        grads = [p.grad for p in params if p.grad is not None]
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.scaler is None:
            for opt in opts:
                opt.step()
        else:
            for opt in opts:
                self.scaler.step(opt)
            self.scaler.update()
        return norm.detach()

    def _update_actor(self, obs: torch.Tensor, eps: torch.Tensor, alpha: torch.Tensor,
                      q_obs: torch.Tensor | None = None):
        # Critic frozen for this backward: no (unused) critic weight gradients are computed.
        self.critic.requires_grad_(False)
        try:
            with self._autocast:
                # Through actor_train's forward, so DDP (grad_average="ddp") sees the pass and reduces.
                action, log_prob = self.actor.squash(*self.actor_train(obs), eps)
                q = self.critic.q_value(self.critic(obs if q_obs is None else q_obs, action))
            loss = losses.actor_loss(log_prob.float(), q, alpha, clipped=self.cfg.cdq)
            self._scaled(loss).backward()
        finally:
            self.critic.requires_grad_(True)
        self.actor_average.all_reduce()
        grad_norm = self._clip_and_step([self.actor_opt], self._actor_params)
        self.actor_average.zero_grad()
        self.counters.actor_steps += 1
        return loss.detach(), -log_prob.detach().float().mean(), grad_norm

    # -- state -------------------------------------------------------------------------------------

    def learner_state(self) -> dict:
        return {
            "actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(), "log_alpha": self.log_alpha.detach().clone(),
            # per-parameter optimizer state in the per-head critic's order, whatever the layout here
            "critic_opt": optimizer_state_out(self.critic_opt.state_dict(), self._reshapes["critic"]),
            "actor_opt": optimizer_state_out(self.actor_opt.state_dict(), self._reshapes["actor"]),
            "alpha_opt": self.alpha_opt.state_dict(),
            "counters": [self.counters.iteration, self.counters.critic_steps, self.counters.actor_steps],
            **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_learner_state(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.critic_opt.load_state_dict(optimizer_state_in(state["critic_opt"], self._reshapes["critic"]))
        self.actor_opt.load_state_dict(optimizer_state_in(state["actor_opt"], self._reshapes["actor"]))
        self.alpha_opt.load_state_dict(state["alpha_opt"])
        self.counters = Counters(*[int(x) for x in state["counters"]])
        if self.scaler is not None and "scaler" in state:  # --amp fp16 resumed from an fp16 checkpoint
            self.scaler.load_state_dict(state["scaler"])

    def broadcast_tensors(self) -> list[torch.Tensor]:
        """Everything rank 0 broadcasts at start-up and after a resume (flat: three buffers)."""
        if self.flat:
            return [*self._flat_actor.buffers.values(), *self._flat_critic.buffers.values(),
                    *self._flat_target.buffers.values()]
        return [*self.actor.parameters(), *self.critic.parameters(), *self.critic_target.parameters(),
                self.log_alpha]
