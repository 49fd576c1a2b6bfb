"""The steps of FastSAC's update (hpcrl/sac/update.py) with autograd and the optimizers, as torch runs them
without ``--compile``: any :class:`hpcrl.sac.params.ParamLayout`, every gradient-averaging mode (DDP sees
the forward passes it must), the overlap of the all-reduce with backward, and the fp16 GradScaler.

Order of one optimizer update (holosoma's, docs/holosoma.md#data-parallelism): backward (of the loss
times the GradScaler's scale under ``--amp fp16``) -> all-reduce of the (scaled) gradients on the
device plane -> ``unscale_`` -> clip to ``max_grad_norm`` -> step (skipped under fp16 when a gradient
is inf/NaN). Every rank holds the same reduced gradients after the all-reduce, so clipping, the
inf check and the skip are identical on every rank by construction: an inf on one rank becomes an
inf in everybody's sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .update import Data, Nets, Steps, actor_objective, critic_objective

if TYPE_CHECKING:
    from .agent import FastSAC


class EagerSteps(Steps):
    """The update's steps on one :class:`FastSAC`'s modules, optimizers and averagers (no ``state``: they
    mutate the agent's own tensors)."""

    def __init__(self, agent: "FastSAC") -> None:
        self.agent = agent
        # Through the averagers' wrappers, so DDP (grad_average="ddp") sees the passes it reduces.
        critic_train = agent.critic_average.wrap(agent.critic)
        actor_train = agent.actor_average.wrap(agent.actor)
        self.critic_nets = Nets(agent.actor.sample, critic_train, agent.critic_target)
        self.actor_nets = Nets(lambda obs, eps: agent.actor.squash(*actor_train(obs), eps), agent.critic, None)

    def critic_grad(self, state: None, data: Data) -> tuple:
        agent = self.agent
        loss, aux = critic_objective(self.critic_nets, agent.log_alpha, data, agent.objective)
        self._scaled(loss).backward()
        return aux

    def reduce_critic(self) -> None:
        self.agent.critic_average.all_reduce()  # of the scaled gradients (fp16), like holosoma

    def critic_step(self, state: None) -> torch.Tensor:
        agent = self.agent
        opts = [agent.critic_opt, agent.alpha_opt] if agent.cfg.autotune_alpha else [agent.critic_opt]
        norm = self._clip_and_step(opts, agent.layout.critic)
        agent.critic_average.zero_grad()
        with torch.no_grad():  # flat: one lerp over the target buffer
            torch._foreach_lerp_(agent.layout.target, agent.layout.critic, agent.cfg.tau)
        return norm

    def actor_grad(self, state: None, data: Data, alpha: torch.Tensor) -> tuple:
        critic = self.agent.critic
        # Critic frozen for this backward: no (unused) critic weight gradients are computed.
        critic.requires_grad_(False)
        try:
            loss, aux = actor_objective(self.actor_nets, data, alpha, self.agent.objective)
            self._scaled(loss).backward()
        finally:
            critic.requires_grad_(True)
        return aux

    def reduce_actor(self) -> None:
        self.agent.actor_average.all_reduce()

    def actor_step(self, state: None) -> torch.Tensor:
        agent = self.agent
        norm = self._clip_and_step([agent.actor_opt], agent.layout.actor)
        agent.actor_average.zero_grad()
        return norm

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        scaler = self.agent.scaler
        return loss if scaler is None else scaler.scale(loss)

    def _clip_and_step(self, opts: list[torch.optim.Optimizer], params: list[torch.Tensor]) -> torch.Tensor:
        """unscale_ (fp16) -> clip -> step -> scaler.update, on gradients already all-reduced. Returns
        the (unscaled, pre-clip) gradient norm of ``params`` as a tensor (no host read). With the scaler
        the step of a fused optimizer takes the found-inf flag on the device (no host read either)."""
        scaler, max_norm = self.agent.scaler, float(self.agent.cfg.max_grad_norm)
        if scaler is not None:
            for opt in opts:
                scaler.unscale_(opt)
        grads = [p.grad for p in params if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if scaler is None:
            for opt in opts:
                opt.step()
        else:
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        return norm.detach()
