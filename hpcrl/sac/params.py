"""Where the learner's parameters live (:class:`ParamLayout`): per-parameter tensors, or one flat buffer per
model (hpcrl/sac/flat.py). The optimizers, the Polyak update, the gradient averagers, checkpoints and the
captured update (hpcrl/sac/functional.py) all read it from here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .flat import FlatParams, Reshape
from .networks import BatchedCritic


@dataclass(frozen=True)
class ModuleViews:
    """Where a module's parameters sit in its flat buffer: names, offsets, shapes (all static)."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]

    @staticmethod
    def of(module: nn.Module, flat: FlatParams) -> "ModuleViews":
        named = list(module.named_parameters())
        return ModuleViews(tuple(n for n, _ in named), tuple(flat.offset(p) for _, p in named),
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


class ParamLayout:
    """What the optimizers, the Polyak update and the averagers step. Per-parameter (``flat`` False: what
    DDP needs, it reduces its own buckets), or one alias per model over its flat buffer: critic and
    log-alpha share one buffer (one collective), the target has its own (Polyak is one lerp).

    ``critic`` / ``actor`` / ``target``: the tensors the critic and actor optimizers and the Polyak update
    step. ``critic_grads`` / ``actor_grads``: the parameters each averager reduces, and their flat gradient
    buffers (None per-parameter). ``reshapes``: from the optimizers' layout to the per-parameter,
    per-head one that checkpoints hold."""

    def __init__(self, critic: nn.Module, actor: nn.Module, target: nn.Module, log_alpha: nn.Parameter,
                 flat: bool) -> None:
        self.flat = flat
        critic_params, actor_params = list(critic.parameters()), list(actor.parameters())
        self.critic_grads = [*critic_params, log_alpha]
        self.actor_grads = actor_params
        self.reshapes: dict[str, list[Reshape]] = {"actor": [], "critic": []}
        if isinstance(critic, BatchedCritic):
            heads = critic.to_heads(critic_params)
            self.reshapes["critic"].append(Reshape([p.shape for p in critic_params], [h.shape for h in heads],
                                                   critic.to_heads, critic.from_heads))
        self.flat_critic = self.flat_actor = self.flat_target = None
        if not flat:
            self.critic, self.actor, self.target = critic_params, actor_params, list(target.parameters())
            self.critic_buffers = self.actor_buffers = None
            return
        self.flat_critic = FlatParams(self.critic_grads)
        self.flat_actor = FlatParams(actor_params)
        self.flat_target = FlatParams(list(target.parameters()), grads=False)
        self.critic = [self.flat_critic.alias(critic_params)]
        self.actor = [self.flat_actor.alias()]
        self.target = [self.flat_target.alias()]
        self.reshapes["critic"].insert(0, self.flat_critic.reshape(critic_params))
        self.reshapes["actor"].append(self.flat_actor.reshape())
        self.critic_buffers = list(self.flat_critic.grad_buffers.values())
        self.actor_buffers = list(self.flat_actor.grad_buffers.values())

    def flats(self) -> tuple[FlatParams, FlatParams, FlatParams]:
        """(critic + log-alpha, actor, target) flat parameters; only with ``flat``."""
        if not self.flat:
            raise ValueError("per-parameter layout: no flat buffers")
        return self.flat_critic, self.flat_actor, self.flat_target
