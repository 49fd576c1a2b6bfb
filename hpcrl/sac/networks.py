"""FastSAC networks (holosoma semantics: docs/holosoma.md#actor, #critic-a-distributional-ensemble).

Actor: LayerNorm+SiLU trunk (H, H/2, H/4), zero-initialised mean and log-std heads, log-std squashed
into [log_std_min, log_std_max], tanh-squashed Gaussian scaled to the action box.
Critic: ``num_q`` independent C51 heads (LayerNorm+SiLU trunk, ``num_atoms`` logits) over a fixed
support [v_min, v_max]; each head is trained against its own target head (no clipped double-Q).
:class:`BatchedCritic` is the same network evaluated as one batched matmul per layer over stacked
weights; its state dict is the per-head one, so checkpoints do not depend on which of the two ran.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp_trunk(in_dim: int, hidden: int, layer_norm: bool) -> tuple[nn.Sequential, int]:
    layers: list[nn.Module] = []
    for width in (hidden, hidden // 2, hidden // 4):
        layers += [nn.Linear(in_dim, width), nn.LayerNorm(width) if layer_norm else nn.Identity(), nn.SiLU()]
        in_dim = width
    return nn.Sequential(*layers), in_dim


class Actor(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, hidden: int, action_low: torch.Tensor,
                 action_high: torch.Tensor, layer_norm: bool = True, log_std_min: float = -5.0,
                 log_std_max: float = 0.0) -> None:
        super().__init__()
        self.trunk, width = mlp_trunk(obs_dim, hidden, layer_norm)
        self.mean = nn.Linear(width, action_dim)
        self.log_std = nn.Linear(width, action_dim)
        for head in (self.mean, self.log_std):  # initial policy: mean 0, log-std mid-range
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.register_buffer("action_scale", ((action_high - action_low) / 2).float().reshape(-1))
        self.register_buffer("action_bias", ((action_high + action_low) / 2).float().reshape(-1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        raw = torch.tanh(self.log_std(h))
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (raw + 1)
        return self.mean(h), log_std

    def sample(self, obs: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised action for standard-normal noise ``eps``, and its log-density."""
        return self.squash(*self(obs), eps)

    def squash(self, mean: torch.Tensor, log_std: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Action ``tanh(mean + std * eps)`` in the env's box and its log-density.

        The log-density includes the tanh and the action-scale Jacobians (the density of the action
        actually sent to the env), as holosoma does.
        """
        u = mean + log_std.exp() * eps
        a = torch.tanh(u)
        log_prob = (-0.5 * eps.square() - log_std - 0.5 * math.log(2 * math.pi)
                    - torch.log(1 - a.square() + 1e-6) - torch.log(self.action_scale + 1e-6))
        return a * self.action_scale + self.action_bias, log_prob.sum(-1)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None,
            deterministic: bool = False) -> torch.Tensor:
        if deterministic:
            mean, _ = self(obs)
            return torch.tanh(mean) * self.action_scale + self.action_bias
        eps = torch.randn(obs.shape[0], self.action_scale.numel(), generator=generator, device=obs.device)
        return self.sample(obs, eps)[0]


class DistributionalCritic(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, hidden: int, num_q: int = 2, num_atoms: int = 101,
                 v_min: float = -20.0, v_max: float = 20.0, layer_norm: bool = True) -> None:
        super().__init__()
        if not v_min < v_max:
            raise ValueError(f"critic support: v_min={v_min} must be < v_max={v_max}")
        heads = []
        for _ in range(num_q):
            trunk, width = mlp_trunk(obs_dim + action_dim, hidden, layer_norm)
            heads.append(nn.Sequential(*trunk, nn.Linear(width, num_atoms)))
        self.heads = nn.ModuleList(heads)
        self.v_min, self.v_max = float(v_min), float(v_max)
        self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_q, B, num_atoms]``."""
        x = torch.cat([obs, action], dim=-1)
        return torch.stack([head(x) for head in self.heads])

    def q_value(self, logits: torch.Tensor) -> torch.Tensor:
        """Expected value of each head: ``[num_q, B]``."""
        return (torch.softmax(logits.float(), dim=-1) * self.support).sum(-1)


class BatchedCritic(nn.Module):
    """:class:`DistributionalCritic` with every layer's heads stacked: weights ``[num_q, out, in]``
    (each head's slice laid out as its ``nn.Linear`` weight), one ``baddbmm`` per layer for all heads.

    Initialised from a freshly built per-head critic, so the same seed gives the same weights.
    ``state_dict()`` writes and ``load_state_dict()`` reads the per-head keys (``heads.{i}.{j}.*``).
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden: int, num_q: int = 2, num_atoms: int = 101,
                 v_min: float = -20.0, v_max: float = 20.0, layer_norm: bool = True) -> None:
        super().__init__()
        heads = DistributionalCritic(obs_dim, action_dim, hidden, num_q, num_atoms, v_min, v_max, layer_norm)
        self.num_q, self.layer_norm = num_q, layer_norm
        self.v_min, self.v_max = heads.v_min, heads.v_max
        self.register_buffer("support", heads.support.clone())
        self._head_names = [n for n, _ in heads.heads[0].named_parameters()]  # e.g. 0.weight, 1.weight, ...
        kinds = {nn.Linear: "linear", nn.LayerNorm: "norm", nn.SiLU: "silu"}
        self._plan = [(kinds[type(m)], j) for j, m in enumerate(heads.heads[0]) if type(m) in kinds]
        self._eps = next((m.eps for m in heads.heads[0] if isinstance(m, nn.LayerNorm)), 1e-5)
        for name, value in zip(self.batched_names(), stack_heads(heads.heads, self._head_names)):
            self.register_parameter(name, nn.Parameter(value))

    def batched_names(self) -> list[str]:
        """``layer{j}_{weight|bias}`` for every per-head parameter name ``{j}.{weight|bias}``."""
        return ["layer" + n.replace(".", "_") for n in self._head_names]

    def per_head_names(self) -> list[str]:
        """The per-head parameter names, in the per-head network's parameter order."""
        return [f"heads.{i}.{n}" for i in range(self.num_q) for n in self._head_names]

    def to_heads(self, stacked: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped like this module's parameters -> views shaped like the per-head parameters."""
        return [stacked[k][i] for i in range(self.num_q) for k in range(len(self._head_names))]

    def from_heads(self, per_head: list[torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of :meth:`to_heads` (stacked copies)."""
        n = len(self._head_names)
        return [torch.stack([per_head[i * n + k] for i in range(self.num_q)]) for k in range(n)]

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_q, B, num_atoms]``."""
        x = torch.cat([obs, action], dim=-1)
        h = x.expand(self.num_q, *x.shape)
        for kind, j in self._plan:
            if kind == "silu":
                h = F.silu(h)
                continue
            weight, bias = getattr(self, f"layer{j}_weight"), getattr(self, f"layer{j}_bias").unsqueeze(1)
            if kind == "linear":
                h = torch.baddbmm(bias, h, weight.mT)
            else:  # each head's LayerNorm with its own affine: fused, unlike a shared norm then addcmul
                h = torch.stack([F.layer_norm(x, h.shape[-1:], w, b, self._eps)
                                 for x, w, b in zip(h.unbind(), weight.unbind(), bias.squeeze(1).unbind())])
        return h

    def q_value(self, logits: torch.Tensor) -> torch.Tensor:
        """Expected value of each head: ``[num_q, B]``."""
        return (torch.softmax(logits.float(), dim=-1) * self.support).sum(-1)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "support"] = self.support if keep_vars else self.support.detach()
        params = [p if keep_vars else p.detach() for p in self.parameters(recurse=False)]
        for name, value in zip(self.per_head_names(), self.to_heads(params)):
            destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        keys = [prefix + n for n in self.per_head_names()]
        if all(k in state_dict for k in keys):  # else the base class reports the missing keys
            stacked = self.from_heads([state_dict.pop(k) for k in keys])
            state_dict.update({prefix + n: v for n, v in zip(self.batched_names(), stacked)})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def stack_heads(heads: nn.ModuleList, names: list[str]) -> list[torch.Tensor]:
    """Every per-head parameter ``name`` stacked over the heads: ``[num_q, *shape]``."""
    params = [dict(h.named_parameters()) for h in heads]
    return [torch.stack([p[n].detach() for p in params]) for n in names]
