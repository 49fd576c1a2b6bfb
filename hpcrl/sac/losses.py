"""FastSAC losses as pure functions (docs/holosoma.md#losses), so tests can hit them directly."""

from __future__ import annotations

import torch


def categorical_projection(next_probs: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor,
                           support: torch.Tensor) -> torch.Tensor:
    """Project the distribution ``reward + discount * Z`` onto ``support`` (C51).

    ``next_probs`` is ``[..., B, N]``; ``reward`` and ``discount`` are ``[B]`` (``discount`` is
    gamma^k, 0 after a termination). Returns ``[..., B, N]`` with the mass of every row preserved.
    Uses ``scatter_add_`` along the atom axis: no flattened offsets (holosoma's float32 linspace
    offsets break above 2^24 elements) and no index clamp.
    """
    v_min, v_max = support[0], support[-1]
    delta = (v_max - v_min) / (support.numel() - 1)
    tz = (reward[:, None] + discount[:, None] * support[None, :]).clamp(v_min, v_max)
    b = ((tz - v_min) / delta).clamp(0, support.numel() - 1)
    lower, upper = b.floor(), b.ceil()
    # Split the mass between the two neighbouring atoms; an exact hit puts it all on one atom.
    w_lower = (upper - b) + (lower == upper).to(b.dtype)
    w_upper = b - lower
    shape = next_probs.shape
    lower = lower.long().expand(shape)
    upper = upper.long().expand(shape)
    proj = torch.zeros_like(next_probs)
    proj.scatter_add_(-1, lower, next_probs * w_lower)
    proj.scatter_add_(-1, upper, next_probs * w_upper)
    return proj


def lowest_head(next_probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Clipped double Q for return distributions (FastTD3's CDQ): per sample, the distribution of the
    head whose expected value is lowest, ``[num_q, B, N] -> [1, B, N]`` (every head's target)."""
    low = (next_probs * support).sum(-1).argmin(0)  # [B]
    return next_probs.gather(0, low[None, :, None].expand(1, *next_probs.shape[1:]))


def target_distribution(target_logits: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor,
                        support: torch.Tensor, clipped: bool) -> torch.Tensor:
    """The critic's projected target from the target heads' logits ``[num_q, B, N]``: every head its own
    (holosoma) or, ``clipped``, each sample's lowest head (:func:`lowest_head`) for all of them."""
    probs = torch.softmax(target_logits.float(), -1)
    if clipped:
        probs = lowest_head(probs, support)
    return categorical_projection(probs, reward, discount, support)


def critic_loss(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each head against its projected target (``[num_q or 1, B, N]``), mean over the
    batch, summed over heads."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(target_probs * log_p).sum(-1).mean(-1).sum()


def soft_reward(reward: torch.Tensor, discount: torch.Tensor, alpha: torch.Tensor,
                next_log_prob: torch.Tensor) -> torch.Tensor:
    """Entropy bonus of the bootstrap state folded into the reward: r - discount * alpha * log pi(a'|s')."""
    return reward - discount * alpha * next_log_prob


def actor_loss(log_prob: torch.Tensor, q_values: torch.Tensor, alpha: torch.Tensor,
               clipped: bool = False) -> torch.Tensor:
    """mean(alpha * log pi - Q), Q the mean over heads (holosoma) or their minimum (``clipped``, CDQ);
    ``q_values`` is ``[num_q, B]``."""
    q = q_values.min(0).values if clipped else q_values.mean(0)
    return (alpha * log_prob - q).mean()


def alpha_loss(log_alpha: torch.Tensor, log_prob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """Temperature loss with detached log-probs (holosoma: the next-state ones of the critic target)."""
    return -(log_alpha.exp() * (log_prob.detach() + target_entropy)).mean()
