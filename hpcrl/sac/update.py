"""FastSAC's update, once: the order of its steps (:func:`run_update`) and its two objectives
(:func:`critic_objective`, :func:`actor_objective`).

Both paths run this code. The eager one (:class:`hpcrl.sac.eager.EagerSteps`) takes gradients with
autograd and steps the optimizers, so it serves every layout, gradient-averaging mode, the overlap of the
all-reduce with backward and the fp16 GradScaler; the captured one (:class:`hpcrl.sac.functional.Functional`,
compiled by hpcrl/sac/compiled.py under ``--compile``) takes them with ``torch.func.grad`` over flat
buffers and steps with the fused optimizers' arithmetic as plain tensor ops (their kernels, DDP's and the
overlap's backward hooks do not trace; the two agree to float rounding, not bit for bit). Which of them
runs, and which averaging mode, critic, overlap or precision, are parameters of these steps, not branches
of the update.

The order (holosoma's, docs/holosoma.md#data-parallelism), cut at the two gradient all-reduces::

    critic_stage   target (no grad) + critic and alpha losses + their gradient
    -- reduce_critic (critic + log-alpha) --
    middle_stage   clip -> AdamW (critic) + Adam (alpha) -> zero the gradient -> Polyak
                   [-> actor loss through the stepped critic + its gradient]
    -- reduce_actor --
    actor_stage    clip -> AdamW (actor) -> zero the gradient
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, NamedTuple

import torch

from . import losses


class Data(NamedTuple):
    """One update's batch and noise, as the update reads them."""

    q_obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: torch.Tensor
    q_next_obs: torch.Tensor
    discount: torch.Tensor
    obs: torch.Tensor
    next_eps: torch.Tensor
    actor_eps: torch.Tensor

    @staticmethod
    def of(batch, noise) -> "Data":
        """From a :class:`hpcrl.replay.Batch` and an :class:`hpcrl.sac.agent.UpdateNoise`."""
        return Data(batch.q_obs, batch.action, batch.reward, batch.next_obs, batch.q_next_obs, batch.discount,
                    batch.obs, noise.next_eps, noise.actor_eps)


class Nets(NamedTuple):
    """The networks as one objective calls them: modules (eager) or modules on buffer views (captured)."""

    sample: Callable  # (obs, eps) -> (action, log_prob) of the actor
    critic: Callable  # (obs, action) -> logits [heads, batch, atoms]
    target: Callable | None  # the target critic, same signature (the critic objective only)


class Objective(NamedTuple):
    """The constants of both objectives."""

    support: torch.Tensor  # the critic's return atoms
    q_value: Callable  # the critic's logits -> Q values of its heads
    target_entropy: float
    cdq: bool
    autocast: ContextManager  # torch.autocast under --amp, else a null context


def critic_objective(nets: Nets, log_alpha: torch.Tensor, data: Data, o: Objective):
    """critic + alpha loss (one backward fills both gradients: disjoint graphs), and
    (critic_loss, alpha_loss, alpha) detached."""
    alpha = log_alpha.detach().exp()
    with torch.no_grad(), o.autocast:
        next_action, next_log_prob = nets.sample(data.next_obs, data.next_eps)
        next_log_prob = next_log_prob.float()
        target_logits = nets.target(data.q_next_obs, next_action)
        reward = losses.soft_reward(data.reward, data.discount, alpha, next_log_prob)
        target = losses.target_distribution(target_logits, reward, data.discount, o.support, o.cdq)
    with o.autocast:
        logits = nets.critic(data.q_obs, data.action)
    critic_loss = losses.critic_loss(logits, target)
    alpha_loss = losses.alpha_loss(log_alpha, next_log_prob, o.target_entropy)
    return critic_loss + alpha_loss, (critic_loss.detach(), alpha_loss.detach(), alpha)


def actor_objective(nets: Nets, data: Data, alpha: torch.Tensor, o: Objective):
    """The actor loss through the (fixed) critic, and (loss, entropy) detached."""
    with o.autocast:
        action, log_prob = nets.sample(data.obs, data.actor_eps)
        q = o.q_value(nets.critic(data.q_obs, action))
    loss = losses.actor_loss(log_prob.float(), q, alpha, clipped=o.cdq)
    return loss, (loss.detach(), -log_prob.detach().float().mean())


class Steps:
    """The update's steps on some ``state`` (what a step mutates, passed in: the captured graphs take it as
    their inputs). The stages default to compositions of the steps; the reduces to nothing (one rank)."""

    def critic_grad(self, state: Any, data: Data) -> tuple:
        raise NotImplementedError

    def critic_step(self, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def actor_grad(self, state: Any, data: Data, alpha: torch.Tensor) -> tuple:
        raise NotImplementedError

    def actor_step(self, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def reduce_critic(self) -> None:
        pass

    def reduce_actor(self) -> None:
        pass

    def critic_stage(self, state: Any, data: Data) -> tuple:
        return self.critic_grad(state, data)

    def middle_stage(self, state: Any, data: Data, alpha: torch.Tensor, actor_due: bool) -> dict:
        out = {"critic_grad_norm": self.critic_step(state)}
        if actor_due:
            out["actor_loss"], out["entropy"] = self.actor_grad(state, data, alpha)
        return out

    def actor_stage(self, state: Any) -> torch.Tensor:
        return self.actor_step(state)


def run_update(steps: Steps, state: Any, data: Data, actor_due: bool) -> dict[str, torch.Tensor]:
    """One critic (+alpha) step, the target update, and the actor step when it is due: detached scalar
    tensors (no host read) for logging."""
    critic_loss, alpha_loss, alpha = steps.critic_stage(state, data)
    steps.reduce_critic()
    out = {"critic_loss": critic_loss, "alpha_loss": alpha_loss, **steps.middle_stage(state, data, alpha, actor_due)}
    if actor_due:
        steps.reduce_actor()
        out["actor_grad_norm"] = steps.actor_stage(state)
    return out
