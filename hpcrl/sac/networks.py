"""FastSAC networks (holosoma semantics: docs/holosoma.md#actor, #critic-a-distributional-ensemble).

Actor: LayerNorm+SiLU trunk (H, H/2, H/4), zero-initialised mean and log-std heads, log-std squashed
into [log_std_min, log_std_max], tanh-squashed Gaussian scaled to the action box.
Critic: ``num_q`` independent C51 heads (LayerNorm+SiLU trunk, ``num_atoms`` logits) over a fixed
support [v_min, v_max]; each head is trained against its own target head (no clipped double-Q).
"""

from __future__ import annotations

import math

import torch
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
