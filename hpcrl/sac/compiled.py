"""``--compile``: FastSAC's whole update step captured by ``torch.compile``, in four graphs between the
two gradient all-reduces (the named break points, which stay eager collectives on the device plane):

    critic_loss   target (no grad) + online critic forward + critic and alpha losses; its backward is
                  AOT-compiled by inductor and runs when the eager ``.backward()`` is called
    -- GradAverager.all_reduce (critic + log-alpha) --
    critic_step   grad norm (clip) -> fused AdamW (critic) + Adam (alpha) -> zero the grad buffer -> Polyak
    actor_loss    actor forward through the (frozen) critic; backward AOT-compiled as above
    -- GradAverager.all_reduce (actor) --
    actor_step    grad norm (clip) -> fused AdamW (actor) -> zero the grad buffer

Same arithmetic in the same order as :meth:`FastSAC.update` (the eager path), so the two agree to float
rounding (inductor fuses elementwise ops; tests/test_sac_compile.py states the tolerance). Every graph
has static shapes and reads nothing back to the host, so on CUDA it runs as a CUDA graph
(``mode="reduce-overhead"``). Compiled code is cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``,
else its default under /tmp), so a second run on the same machine skips most of the one-time cost that
:attr:`CompiledUpdate.compile_s` reports.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._inductor.runtime.cache_dir_utils import cache_dir

from hpcrl.config_check import ConfigError

from . import losses

if TYPE_CHECKING:
    from hpcrl.replay import Batch

    from .agent import FastSAC, UpdateNoise


def supported(agent: "FastSAC") -> str | None:
    """Why ``agent`` cannot run the captured update (None: it can)."""
    if not agent.flat:
        return "--compile needs flat parameters (flat_params on, grad_average 'flat' or 'view')"
    if agent.scaler is not None:
        return "--compile does not capture the fp16 GradScaler (use --amp bf16 or none)"
    return None


class CompiledUpdate:
    """The captured update of one :class:`FastSAC` (same parameters, optimizers and averagers)."""

    def __init__(self, agent: "FastSAC") -> None:
        reason = supported(agent)
        if reason is not None:
            raise ConfigError(reason)
        self.agent = agent
        cuda = agent.log_alpha.device.type == "cuda"
        compile_ = dict(dynamic=False, mode="reduce-overhead" if cuda else None)
        self._critic_loss = torch.compile(self._critic_loss_eager, fullgraph=True, **compile_)
        self._actor_loss = torch.compile(self._actor_loss_eager, fullgraph=True, **compile_)
        # Optimizer.step breaks the graph on purpose around its body (torch/optim/optimizer.py, so
        # that AOT sees a no-grad graph): a step is three graphs, norm | step | zero + Polyak.
        self._critic_step = torch.compile(self._critic_step_eager, **compile_)
        self._actor_step = torch.compile(self._actor_step_eager, **compile_)
        if cuda:  # buffers the step graphs mutate keep their addresses: CUDA graphs may capture them
            for flat in (agent._flat_critic, agent._flat_actor, agent._flat_target):
                for buffer in (*flat.buffers.values(), *flat.grad_buffers.values()):
                    torch._dynamo.mark_static_address(buffer)
        # A CUDA graph's outputs are overwritten by its next replay; the loop keeps metrics across updates.
        self._keep = (lambda t: t.detach().clone()) if cuda else (lambda t: t.detach())
        self.compile_s = 0.0  # wall seconds of the first critic and first actor update (compilation)
        self._warm = {"critic": False, "actor": False}

    def update(self, batch: "Batch", noise: "UpdateNoise") -> dict[str, torch.Tensor]:
        """What :meth:`FastSAC.update` does, captured."""
        agent = self.agent
        actor_due = (agent.counters.critic_steps + 1) % agent.cfg.policy_frequency == 0
        start = time.perf_counter()
        critic_loss, alpha_loss = self._critic_loss(batch.q_obs, batch.action, batch.reward, batch.next_obs,
                                                    batch.q_next_obs, batch.discount, noise.next_eps)
        (critic_loss + alpha_loss).backward()
        agent.critic_average.all_reduce()
        keep = self._keep
        out = {"critic_loss": keep(critic_loss), "alpha_loss": keep(alpha_loss), "critic_grad_norm": keep(self._critic_step())}
        agent.counters.critic_steps += 1
        self._count_compile("critic", start)
        if actor_due:
            start = time.perf_counter()
            agent.critic.requires_grad_(False)  # as eager: no critic weight gradients in the actor's backward
            try:
                loss, entropy = self._actor_loss(batch.obs, noise.actor_eps, batch.q_obs)
                loss.backward()
            finally:
                agent.critic.requires_grad_(True)
            agent.actor_average.all_reduce()
            out["actor_loss"], out["entropy"], out["actor_grad_norm"] = keep(loss), keep(entropy), keep(self._actor_step())
            agent.counters.actor_steps += 1
            self._count_compile("actor", start)
        return out

    def _count_compile(self, part: str, start: float) -> None:
        """Add a first call's wall time to :attr:`compile_s`; once every part ran, report it (one line, rank 0)."""
        if self._warm[part]:
            return
        self._warm[part] = True
        self.compile_s += time.perf_counter() - start
        if all(self._warm.values()) and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"hpcrl.sac: --compile: update compiled in {self.compile_s:.1f} s "
                  f"(inductor cache {cache_dir()})", flush=True)

    # -- the captured graphs: plain functions of tensors, the modules and optimizers read from the agent

    def _critic_loss_eager(self, q_obs, action, reward, next_obs, q_next_obs, discount, next_eps):
        agent = self.agent
        alpha = agent.log_alpha.exp().detach()
        with torch.no_grad(), agent._autocast:
            next_action, next_log_prob = agent.actor.sample(next_obs, next_eps)
            next_log_prob = next_log_prob.float()
            target_logits = agent.critic_target(q_next_obs, next_action)
            soft = losses.soft_reward(reward, discount, alpha, next_log_prob)
            target = losses.categorical_projection(torch.softmax(target_logits.float(), -1), soft, discount,
                                                   agent.critic.support)
        with agent._autocast:
            logits = agent.critic(q_obs, action)
        return (losses.critic_loss(logits, target),
                losses.alpha_loss(agent.log_alpha, next_log_prob, agent.target_entropy))

    def _critic_step_eager(self) -> torch.Tensor:
        agent = self.agent
        opts = [agent.critic_opt, agent.alpha_opt] if agent.cfg.autotune_alpha else [agent.critic_opt]
        norm = self._clip_and_step(opts, agent._online_params)
        _zero(agent._flat_critic.grad_buffers.values())
        torch._foreach_lerp_(agent._target_params, agent._online_params, agent.cfg.tau)
        return norm

    def _actor_loss_eager(self, obs, eps, q_obs):
        agent = self.agent
        alpha = agent.log_alpha.exp().detach()
        with agent._autocast:
            action, log_prob = agent.actor.sample(obs, eps)
            q = agent.critic.q_value(agent.critic(q_obs, action))
        loss = losses.actor_loss(log_prob.float(), q, alpha)
        return loss, -log_prob.detach().float().mean()

    def _actor_step_eager(self) -> torch.Tensor:
        agent = self.agent
        norm = self._clip_and_step([agent.actor_opt], agent._actor_params)
        _zero(agent._flat_actor.grad_buffers.values())
        return norm

    def _clip_and_step(self, opts: list[torch.optim.Optimizer], params: list[torch.Tensor]) -> torch.Tensor:
        grads = [p.grad for p in params]
        if self.agent.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.agent.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        for opt in opts:
            opt.step()
        return norm.detach()


def _zero(buffers) -> None:
    """What ``GradAverager.zero_grad`` does in view mode: backward accumulated into the buffer in place."""
    for buffer in buffers:
        buffer.zero_()
