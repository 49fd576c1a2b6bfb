"""PPO math as pure functions (docs/coati.md#staleness-bound-and-correction), so tests can hit them directly.

Conventions:

* Time-major ``[T, N]`` for GAE; anything else is elementwise over any shape.
* Losses are to be *minimised* and are means over the elements (or over ``mask`` where given:
  the LM workload passes its action mask for a token-mean loss).
* Stats are detached 0-d tensors, not floats: reading them is the caller's (one) host read.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over the elements where ``mask`` is true (all elements when ``mask`` is None).
    An all-false mask gives 0, not NaN (an empty minibatch contributes nothing)."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    dones: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over time-major ``[T, N]`` tensors.

    ``values[t] = V(obs[t])``; ``next_values[t] = V(next_obs[t])`` where ``next_obs`` is the
    observation that truly followed action ``t`` (the final observation where the episode ended, not
    the auto-reset one). ``terminated``/``dones`` are bool or 0/1 with ``dones = terminated |
    truncated``:

        delta[t] = r[t] + gamma * (1 - terminated[t]) * next_values[t] - values[t]
        A[t]     = delta[t] + gamma * lam * (1 - dones[t]) * A[t+1],   A[T] = 0

    so a truncated step still bootstraps from V(final obs), a terminal step does not, and no
    episode's advantage leaks into the previous one. Returns ``(advantages, returns = A + values)``.
    """
    not_term = 1.0 - terminated.to(values.dtype)
    not_done = 1.0 - dones.to(values.dtype)
    deltas = rewards + gamma * not_term * next_values - values
    decay = (gamma * lam) * not_done
    adv = torch.empty_like(values)
    running = torch.zeros_like(values[0])
    for t in range(values.shape[0] - 1, -1, -1):
        running = deltas[t] + decay[t] * running
        adv[t] = running
    return adv, adv + values


def whiten(x: Tensor, eps: float = 1e-8, mask: Tensor | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the population variance over ``x`` (or ``mask``).

    Population variance and eps under the root keep one element (or a constant batch) finite (0)
    where the unbiased ``x.std()`` would give NaN; for hundreds of samples the two agree to <1%.
    Masked-out entries are returned as 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if mask is None else out * mask.to(x.dtype)


def policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    clip_coef: float,
    truncated_is: float | None = None,
    proximal_logp: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate ``-mean(w * min(r A, clip(r, 1 - c, 1 + c) A))``.

    Plain PPO (``proximal_logp`` None): ``r = pi / pi_behaviour`` and ``w = 1``; the behaviour
    log-probs are the ones the maker sampled with, so the ratio is a correct importance weight at any
    staleness, and ``truncated_is`` must be None (there is nothing to truncate).

    Decoupled PPO (Hilton et al. 2021; AReaL) when ``proximal_logp`` is given: the trust region is
    centred on the proximal policy (the trainer's policy at the start of this update),
    ``r = pi / pi_prox``, and the off-policyness of the data is corrected by the detached weight
    ``w = pi_prox / pi_behaviour``, truncated to ``min(w, truncated_is)`` when a cap is given
    (truncated IS: caps the variance a very stale sample can add). With ``pi_prox == pi_behaviour``
    (lag 0) both forms are the same loss.

    Stats: ``clip_frac`` (fraction of elements whose ratio lies outside the clip range),
    ``ratio_mean``; with a proximal policy also ``is_weight_mean`` (after truncation) and
    ``is_trunc_frac`` (fraction of weights that hit the cap).
    """
    if proximal_logp is None and truncated_is is not None:
        raise ValueError("truncated_is needs proximal_logp (pi_prox / pi_behaviour is the weight it caps)")
    anchor = behaviour_logp if proximal_logp is None else proximal_logp
    ratio = torch.exp(logp - anchor)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef) * advantages)
    stats: dict[str, Tensor] = {}
    if proximal_logp is not None:
        weight = torch.exp(proximal_logp - behaviour_logp).detach()
        if truncated_is is not None:
            stats["is_trunc_frac"] = masked_mean((weight > truncated_is).float(), mask)
            weight = weight.clamp(max=truncated_is)
        surrogate = weight * surrogate
        stats["is_weight_mean"] = masked_mean(weight, mask)
    loss = -masked_mean(surrogate, mask)
    with torch.no_grad():
        stats["clip_frac"] = masked_mean(((ratio - 1.0).abs() > clip_coef).float(), mask)
        stats["ratio_mean"] = masked_mean(ratio, mask)
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip_coef: float | None,
    mask: Tensor | None = None,
) -> Tensor:
    """``0.5 * mean((V - R)^2)``; with ``clip_coef``, the pessimistic clipped form
    ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`` where ``old_values`` are
    the critic's values at the start of the update."""
    err = (values - returns).square()
    if clip_coef is not None:
        clipped = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
        err = torch.max(err, (clipped - returns).square())
    return 0.5 * masked_mean(err, mask)


def entropy_bonus(entropy: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """The loss term ``-coef * mean(entropy)`` (negative: minimising it raises the entropy)."""
    return -coef * masked_mean(entropy, mask)


def approx_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Elementwise k3 estimate of KL(p || ref) from samples drawn from p (Schulman, "Approximating
    KL divergence", 2020): with ``u = ref / p``, ``k3 = (u - 1) - log u``.

    Unbiased (E_p[u] = 1) and, unlike ``-log u``, never negative (``x - 1 >= log x``); exactly 0
    where the log-probs agree. PPO's diagnostic is ``approx_kl(behaviour_logp, logp).mean()``
    (samples come from the behaviour policy); the LM penalty is ``approx_kl(logp, ref_logp)``.
    """
    log_u = logp_ref - logp
    return torch.expm1(log_u) - log_u


def per_token_kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: Literal["k3", "k1"] = "k3",
) -> Tensor:
    """Per-token rewards ``-kl_coef * KL_t`` against the frozen reference model, 0 where ``mask``
    is false; ``[B, L]`` in, ``[B, L]`` out. ``KL_t`` is :func:`approx_kl` (k3, >= 0) or k1
    ``logp - ref_logp`` (per-token sign can be negative, but its sum over a sequence is exactly
    ``log pi(y) / pi_ref(y)``)."""
    if estimator == "k3":
        kl = approx_kl(logp, ref_logp)
    elif estimator == "k1":
        kl = logp - ref_logp
    else:
        raise ValueError(f"estimator must be 'k3' or 'k1', not {estimator!r}")
    return -kl_coef * kl * mask.to(kl.dtype)


def last_valid_index(mask: Tensor) -> Tensor:
    """``[B]`` index of the last true entry of each row of a ``[B, L]`` mask (left or right
    padding); rows without any true entry get ``L - 1`` (callers must mask them)."""
    length = mask.shape[-1]
    return length - 1 - mask.flip(-1).to(torch.int8).argmax(-1)


def sequence_rewards_with_kl(
    score: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: Literal["k3", "k1"] = "k3",
) -> Tensor:
    """Token rewards ``[B, L]`` for LM PPO: the per-token KL penalty everywhere in ``mask``, plus the
    sequence score ``[B]`` (reward model) at each row's last valid token. A row with an empty mask
    gets no reward at all."""
    rewards = per_token_kl_penalty(logp, ref_logp, mask, kl_coef, estimator)
    idx = last_valid_index(mask)
    bonus = score.to(rewards.dtype) * mask.any(-1).to(rewards.dtype)
    return rewards.scatter_add(-1, idx.unsqueeze(-1), bonus.unsqueeze(-1))


def token_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
              normalize: bool) -> tuple[Tensor, Tensor]:
    """GAE over ``[B, G]`` response tokens (right-padded ``mask``): the sequence terminates at its last
    action token, so nothing bootstraps past it; advantages are 0 outside ``mask`` and whitened over
    it with ``normalize``. Returns ``(advantages, returns)``, ``[B, G]``."""
    # where each row ends, by scatter: one_hot would read the indices' range on the host
    end = torch.clamp(mask.sum(-1).long() - 1, min=0)
    last = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device).scatter_(-1, end.unsqueeze(-1), 1.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    adv, returns = gae(rewards.T, values.T, next_values.T, last.T, last.T, gamma, lam)  # time-major
    adv, returns = adv.T * mask, returns.T
    return (whiten(adv, mask=mask) if normalize else adv), returns
