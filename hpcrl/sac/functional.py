"""The steps of FastSAC's update (hpcrl/sac/update.py) as pure functions of flat buffers, for ``--compile``
(hpcrl/sac/compiled.py).

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
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.func import functional_call

from .params import ModuleViews
from .update import Data, Nets, Steps, actor_objective, critic_objective

if TYPE_CHECKING:
    from .agent import FastSAC


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


class Functional(Steps):
    """The update's steps as pure functions of tensors: ``state`` is (buffers, gradient buffers, optimizer
    states), all a step mutates, so the captured graphs take it as their inputs. Built on one
    :class:`FastSAC`'s modules, flat layout and optimizers' hyper-parameters (constants of the graphs)."""

    def __init__(self, agent: "FastSAC") -> None:
        self.agent = agent
        flat_critic, flat_actor, flat_target = agent.layout.flats()
        self.critic_views = ModuleViews.of(agent.critic, flat_critic)
        self.actor_views = ModuleViews.of(agent.actor, flat_actor)
        self.target_views = ModuleViews.of(agent.critic_target, flat_target)
        self.alpha_at = flat_critic.offset(agent.log_alpha)
        self.online_span = agent.layout.target[0].numel()  # the critic range the target follows
        self.actor_span = agent.layout.actor[0].numel()
        self.critic_h = AdamHyper.of(agent.critic_opt)
        self.actor_h = AdamHyper.of(agent.actor_opt)
        self.alpha_h = AdamHyper.of(agent.alpha_opt)
        self.autotune = bool(agent.cfg.autotune_alpha)
        self.tau = float(agent.cfg.tau)
        self.max_norm = float(agent.cfg.max_grad_norm)
        self.target_entropy = float(agent.objective.target_entropy)
        self.cdq = bool(agent.objective.cdq)

    def constants(self) -> dict:
        """What the graphs take from here as constants (learning rates, tau, layouts, ...), by name."""
        return {k: v for k, v in vars(self).items() if k != "agent"}

    # -- the networks on flat buffers

    def _sample(self, actor_buf, obs, eps):
        actor = self.agent.actor
        return actor.squash(*functional_call(actor, self.actor_views.views(actor_buf), (obs,)), eps)

    def _critic(self, module, views: ModuleViews, buf, obs, action):
        return functional_call(module, views.views(buf), (obs, action))

    def critic_loss(self, critic_buf, actor_buf, target_buf, data: Data):
        """The critic + alpha objective of the buffers (the actor and target held fixed)."""
        agent = self.agent
        nets = Nets(partial(self._sample, actor_buf.detach()),
                    partial(self._critic, agent.critic, self.critic_views, critic_buf),
                    partial(self._critic, agent.critic_target, self.target_views, target_buf.detach()))
        return critic_objective(nets, critic_buf[self.alpha_at], data, agent.objective)

    def actor_loss(self, actor_buf, critic_buf, data: Data, alpha):
        """The actor objective of the buffers (the critic held fixed)."""
        agent = self.agent
        nets = Nets(partial(self._sample, actor_buf),
                    partial(self._critic, agent.critic, self.critic_views, critic_buf.detach()), None)
        return actor_objective(nets, data, alpha, agent.objective)

    # -- the steps: gradients into the grad buffers, steps from them

    def critic_grad(self, state, data):
        """Critic + log-alpha gradient into the critic grad buffer; (critic_loss, alpha_loss, alpha)."""
        bufs, grads, _ = state
        g, aux = torch.func.grad(self.critic_loss, has_aux=True)(bufs.critic, bufs.actor, bufs.target, data)
        grads.critic.copy_(g)
        return aux

    def critic_step(self, state):
        """clip -> AdamW (critic) + Adam (log-alpha) -> Polyak; the grad buffer is left zeroed."""
        bufs, grads, states = state
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

    def actor_grad(self, state, data, alpha):
        """Actor gradient into the actor grad buffer (the critic, already stepped, held fixed); (loss, entropy)."""
        bufs, grads, _ = state
        g, aux = torch.func.grad(self.actor_loss, has_aux=True)(bufs.actor, bufs.critic, data, alpha)
        grads.actor.copy_(g)
        return aux

    def actor_step(self, state):
        bufs, grads, states = state
        g = grads.actor[: self.actor_span]
        norm = clip_(g, self.max_norm)
        adam_(self.actor_h, bufs.actor[: self.actor_span], g, states.actor)
        grads.actor.zero_()
        return norm
