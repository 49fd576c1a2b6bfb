"""The FastSAC update as pure functions of flat buffers, for ``--compile`` (hpcrl/sac/compiled.py).

Each model is one flat parameter buffer (:class:`hpcrl.sac.flat.FlatParams`); the modules run through
``torch.func.functional_call`` on views of a buffer, and ``torch.func.grad`` differentiates the loss
w.r.t. the whole buffer, so the gradient is one tensor and no autograd engine runs at update time (the
traced backward is part of the same inductor graph). The optimizer steps are the arithmetic of
``torch.optim.AdamW(fused=True)`` / ``Adam(fused=True)`` as plain tensor ops (no optimizer object, no
graph break) on the optimizers' own state tensors, so checkpoints are unchanged; Polyak is one
``lerp_`` over the target buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from . import losses

if TYPE_CHECKING:
    from .agent import FastSAC
    from .flat import FlatParams


@dataclass(frozen=True)
class Layout:
    """Where a module's parameters sit in its flat buffer: names, offsets, shapes (all static)."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]

    @staticmethod
    def of(module: nn.Module, flat: "FlatParams") -> "Layout":
        named = list(module.named_parameters())
        return Layout(tuple(n for n, _ in named), tuple(flat._offsets[id(p)] for _, p in named),
                      tuple(p.shape for _, p in named))

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters as views of ``buffer``, cut by one ``split_with_sizes``: its backward is one
        concatenation (slices' backward would be a masked sum over every parameter per element)."""
        sizes, at = [], 0
        for o, s in zip(self.offsets, self.shapes):
            sizes += [o - at, s.numel()]
            at = o + s.numel()
        sizes.append(buffer.numel() - at)
        pieces = buffer.split_with_sizes(sizes)
        return {n: pieces[2 * i + 1].view(s) for i, (n, s) in enumerate(zip(self.names, self.shapes))}


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (decoupled weight decay) vs Adam

    @staticmethod
    def of(opt: torch.optim.Optimizer) -> "AdamHyper":
        g = opt.param_groups[0]
        if g["amsgrad"] or g["maximize"] or len(opt.param_groups) != 1:
            raise ValueError("the captured step supports one plain Adam/AdamW parameter group")
        return AdamHyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                         float(g["weight_decay"]), bool(g["decoupled_weight_decay"]))


def adam_state(opt: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq, step) of the single parameter of ``opt``, created as the fused eager step
    would on its first call (zeros, a float32 step on the parameter's device)."""
    p = opt.param_groups[0]["params"][0]
    st = opt.state[p]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st["exp_avg"], st["exp_avg_sq"], st["step"]


def adam_(h: AdamHyper, param: torch.Tensor, grad: torch.Tensor, state) -> None:
    """What ``opt.step()`` of a fused CPU Adam/AdamW does for one parameter, as traceable tensor ops
    (its kernel, ``torch._fused_adamw_``, does not functionalize inside a graph in torch 2.13): step += 1,
    decoupled decay, moments, bias-corrected step. Equal to the kernel to float rounding (it forms the
    bias corrections in double)."""
    exp_avg, exp_avg_sq, step = state
    step.add_(1)
    step_size = h.lr / (1 - h.beta1 ** step)
    bias_correction2_sqrt = (1 - h.beta2 ** step).sqrt()
    if h.weight_decay:
        if h.decoupled:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            grad = grad + h.weight_decay * param
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + h.eps
    param.sub_(step_size * exp_avg / denom)


def clip_(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_grad_norm_([grad], max_norm)`` does to one tensor (``get_total_norm`` when 0): the
    pre-clip norm, ``grad`` scaled in place. Plain ops, not its ``_foreach_*`` kernels: those have no C
    shim, and the captured graph's C++ wrapper calling ``_foreach_norm`` through its fallback segfaulted
    (torch 2.13, CPU). To float rounding the same."""
    norm = torch.linalg.vector_norm(grad, 2.0)
    if max_norm > 0:
        grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class Functional:
    """The update's pieces as pure functions of tensors (buffers, optimizer state, batch), built on one
    :class:`FastSAC`'s modules and layouts. All arguments a piece mutates are its inputs."""

    def __init__(self, agent: "FastSAC") -> None:
        self.agent = agent
        self.critic_layout = Layout.of(agent.critic, agent._flat_critic)
        self.actor_layout = Layout.of(agent.actor, agent._flat_actor)
        self.target_layout = Layout.of(agent.critic_target, agent._flat_target)
        self.alpha_at = agent._flat_critic._offsets[id(agent.log_alpha)]
        self.online_span = agent._target_params[0].numel()  # the critic range the target follows
        self.actor_span = agent._actor_params[0].numel()
        self.critic_h = AdamHyper.of(agent.critic_opt)
        self.actor_h = AdamHyper.of(agent.actor_opt)
        self.alpha_h = AdamHyper.of(agent.alpha_opt)
        self.autotune = bool(agent.cfg.autotune_alpha)
        self.tau = float(agent.cfg.tau)
        self.max_norm = float(agent.max_grad_norm)
        self.target_entropy = float(agent.target_entropy)

    # -- losses of flat buffers

    def _actor_sample(self, actor_buf, obs, eps):
        mean, log_std = functional_call(self.agent.actor, self.actor_layout.views(actor_buf), (obs,))
        return self.agent.actor.squash(mean, log_std, eps)

    def critic_loss(self, critic_buf, actor_buf, target_buf, q_obs, action, reward, next_obs, q_next_obs,
                    discount, next_eps):
        agent = self.agent
        log_alpha = critic_buf[self.alpha_at]
        alpha = log_alpha.detach().exp()
        with torch.no_grad(), agent._autocast:
            next_action, next_log_prob = self._actor_sample(actor_buf.detach(), next_obs, next_eps)
            next_log_prob = next_log_prob.float()
            target_logits = functional_call(agent.critic_target, self.target_layout.views(target_buf.detach()),
                                            (q_next_obs, next_action))
            soft = losses.soft_reward(reward, discount, alpha, next_log_prob)
            target = losses.target_distribution(target_logits, soft, discount, agent.critic.support, agent.cfg.cdq)
        with agent._autocast:
            logits = functional_call(agent.critic, self.critic_layout.views(critic_buf), (q_obs, action))
        critic_loss = losses.critic_loss(logits, target)
        alpha_loss = losses.alpha_loss(log_alpha, next_log_prob, self.target_entropy)
        return critic_loss + alpha_loss, (critic_loss.detach(), alpha_loss.detach(), alpha)

    def actor_loss(self, actor_buf, critic_buf, obs, eps, q_obs, alpha):
        agent = self.agent
        with agent._autocast:
            action, log_prob = self._actor_sample(actor_buf, obs, eps)
            q = agent.critic.q_value(functional_call(agent.critic, self.critic_layout.views(critic_buf.detach()),
                                                     (q_obs, action)))
        loss = losses.actor_loss(log_prob.float(), q, alpha, clipped=agent.cfg.cdq)
        return loss, (loss.detach(), -log_prob.detach().float().mean())

    # -- the pieces: gradients into the grad buffers, steps from them

    def critic_grad(self, bufs, grads, data):
        """Critic + log-alpha gradient into ``grads.critic``; (critic_loss, alpha_loss, alpha)."""
        g, aux = torch.func.grad(self.critic_loss, has_aux=True)(
            bufs.critic, bufs.actor, bufs.target, data.q_obs, data.action, data.reward, data.next_obs,
            data.q_next_obs, data.discount, data.next_eps)
        grads.critic.copy_(g)
        return aux

    def critic_step(self, bufs, grads, states):
        """clip -> AdamW (critic) + Adam (log-alpha) -> Polyak; the grad buffer is left zeroed."""
        critic = bufs.critic[: self.online_span]
        g = grads.critic[: self.online_span]
        norm = clip_(g, self.max_norm)
        adam_(self.critic_h, critic, g, states.critic)
        if self.autotune:
            a = self.alpha_at
            adam_(self.alpha_h, bufs.critic[a : a + 1].view(()), grads.critic[a : a + 1].view(()), states.alpha)
        grads.critic.zero_()
        torch._foreach_lerp_([bufs.target[: self.online_span]], [critic], self.tau)
        return norm

    def actor_grad(self, bufs, grads, data, alpha):
        """Actor gradient into ``grads.actor`` (the critic, already stepped, held fixed); (loss, entropy)."""
        g, aux = torch.func.grad(self.actor_loss, has_aux=True)(bufs.actor, bufs.critic, data.obs,
                                                                 data.actor_eps, data.q_obs, alpha)
        grads.actor.copy_(g)
        return aux

    def actor_step(self, bufs, grads, states):
        g = grads.actor[: self.actor_span]
        norm = clip_(g, self.max_norm)
        adam_(self.actor_h, bufs.actor[: self.actor_span], g, states.actor)
        grads.actor.zero_()
        return norm
