"""PPO math as pure functions (docs/coati.md#staleness-bound-and-correction), so tests can hit them directly.

Conventions:

* Time-major ``[T, N]`` for GAE; anything else is elementwise over any shape.
* Losses are to be *minimised* and are means over the elements (or over ``mask`` where given:
  the LM workload passes its action mask for a token-mean loss).
* Stats are detached 0-d tensors, not floats: reading them is the caller's (one) host read.
"""

from __future__ import annotations

import math
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


def weighted_mean(x: Tensor, mask: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
    """``sum(weights * x)`` where ``weights`` are given (:func:`loss_weights`: normalised over a whole
    minibatch, so a micro-batch's share adds up to it), else :func:`masked_mean` over ``mask``."""
    return masked_mean(x, mask) if weights is None else (x * weights.to(x.dtype)).sum()


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


ISLevel = Literal["token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]


def row_weights(mask: Tensor, like: Tensor) -> Tensor:
    """``[B, L]`` weights that average a per-sequence value over a minibatch's sequences: each non-empty
    row's valid tokens share ``1 / rows`` (``rows``: the non-empty ones), so ``sum(w * x[:, None])`` is the
    mean of ``x`` over sequences, and micro-batches' sums add up to it (as :func:`loss_weights`)."""
    m = mask.to(like.dtype)
    length = m.sum(-1, keepdim=True)
    return m / (length.clamp_min(1.0) * (length > 0).sum().clamp_min(1))


def _peak(x: Tensor, valid: Tensor | None) -> Tensor:
    """Max of the non-negative ``x`` where ``valid`` (0 when nothing is)."""
    x = x if valid is None else torch.where(valid, x, torch.zeros_like(x))
    return torch.cat([x.detach().flatten(), x.new_zeros(1)]).max()


def rollout_weights(proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor | None, cap: float | None,
                    level: ISLevel = "token", mode: ISMode = "truncate", stat_weights: Tensor | None = None,
                    sequence_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached rollout-correction weights ``[B, L]`` of decoupled PPO and their stats.

    ``token``: ``w_t = pi_prox / pi_behaviour`` per token; ``sequence``: ``W = exp(sum_t m_t (log pi_prox -
    log pi_behaviour))`` per row (the product of its tokens' ratios); ``geometric``: ``G = exp(mean over the
    row's valid tokens of the same)``; a sequence weight applies to every token of its row (rows are
    sequences: minibatches and micro-batches cut whole rows). ``truncate``: ``min(w, cap)``; ``mask``: a
    weight outside the band is 0 (dropped): ``w_t > cap`` at token level, ``[1 / cap, cap]`` at the
    sequence levels. An empty row has W = G = 1.

    Stats: ``is_weight_mean`` / ``is_weight_max`` of the weights after truncation or masking and
    ``is_trunc_frac`` (share truncated or masked), over valid tokens (``token``; ``stat_weights``) or
    over non-empty sequences (else; ``sequence_weights``, :func:`row_weights` of the whole minibatch)."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"is mode must be 'truncate' or 'mask', not {mode!r}")
    if cap is None and (level != "token" or mode != "truncate"):
        raise ValueError(f"rollout correction {level}/{mode} needs a cap (--ppo.truncated-is)")
    stats: dict[str, Tensor] = {}
    valid = None if mask is None else mask.to(torch.bool)
    if level == "token":
        weight = torch.exp(proximal_logp - behaviour_logp).detach()
        if cap is not None:  # truncate: the same ops as before rollout levels existed (bit-identical)
            hit = weight > cap
            stats["is_trunc_frac"] = weighted_mean(hit.float(), mask, stat_weights)
            weight = weight.clamp(max=cap) if mode == "truncate" else torch.where(hit, torch.zeros_like(weight), weight)
        stats["is_weight_mean"] = weighted_mean(weight, mask, stat_weights)
        stats["is_weight_max"] = _peak(weight, valid)
        return weight, stats
    if mask is None or proximal_logp.dim() != 2:
        raise ValueError(f"--ppo.is-level {level} needs [sequences, tokens] log-probs and a token mask "
                         "(the token workloads hf / lm); use --ppo.is-level token")
    m = mask.to(proximal_logp.dtype)
    log_w = torch.where(valid, proximal_logp - behaviour_logp, torch.zeros_like(m)).sum(-1).detach()
    if level == "geometric":
        log_w = log_w / m.sum(-1).clamp_min(1.0)
    elif level != "sequence":
        raise ValueError(f"is level must be 'token', 'sequence' or 'geometric', not {level!r}")
    w = torch.exp(log_w)
    hit = w > cap if mode == "truncate" else (w > cap) | (w < 1.0 / cap)
    w = w.clamp(max=cap) if mode == "truncate" else torch.where(hit, torch.zeros_like(w), w)
    rows = row_weights(mask, m) if sequence_weights is None else sequence_weights.to(m.dtype)
    stats["is_trunc_frac"] = (hit.to(m.dtype)[:, None] * rows).sum()
    stats["is_weight_mean"] = (w[:, None] * rows).sum()
    stats["is_weight_max"] = _peak(w, valid.any(-1))
    return w[:, None].expand_as(proximal_logp), stats


def policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    clip_coef: float,
    truncated_is: float | None = None,
    proximal_logp: Tensor | None = None,
    mask: Tensor | None = None,
    weights: Tensor | None = None,
    stat_weights: Tensor | None = None,
    is_level: ISLevel = "token",
    is_mode: ISMode = "truncate",
    sequence_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate ``-mean(w * min(r A, clip(r, 1 - c, 1 + c) A))``.

    Plain PPO (``proximal_logp`` None): ``r = pi / pi_behaviour`` and ``w = 1``; the behaviour
    log-probs are the ones the maker sampled with, so the ratio is a correct importance weight at any
    staleness, and ``truncated_is`` must be None (there is nothing to truncate).

    Decoupled PPO (Hilton et al. 2021; AReaL) when ``proximal_logp`` is given: the trust region is
    centred on the proximal policy (the trainer's policy at the start of this update),
    ``r = pi / pi_prox``, and the off-policyness of the data is corrected by the detached weight
    ``w = pi_prox / pi_behaviour`` of :func:`rollout_weights`: per token (``is_level``), per sequence or
    the sequence's geometric mean, truncated at ``truncated_is`` or masked outside its band (``is_mode``).
    With ``pi_prox == pi_behaviour`` (lag 0, same numerics) every form is the same loss.

    Stats: ``clip_frac`` (fraction of elements whose ratio lies outside the clip range),
    ``ratio_mean``; with a proximal policy also :func:`rollout_weights`' ``is_weight_mean``,
    ``is_weight_max`` and (with a cap) ``is_trunc_frac``.

    ``weights`` / ``stat_weights`` (:func:`loss_weights`) replace the mean over ``mask`` of the loss /
    of the stats by a weighted sum (another loss normalisation, or one micro-batch of a minibatch);
    ``sequence_weights`` (:func:`row_weights`) likewise for the stats over sequences.
    """
    if proximal_logp is None and truncated_is is not None:
        raise ValueError("truncated_is needs proximal_logp (pi_prox / pi_behaviour is the weight it caps)")
    anchor = behaviour_logp if proximal_logp is None else proximal_logp
    ratio = torch.exp(logp - anchor)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef) * advantages)
    stats: dict[str, Tensor] = {}
    if proximal_logp is not None:
        weight, stats = rollout_weights(proximal_logp, behaviour_logp, mask, truncated_is, is_level, is_mode,
                                        stat_weights, sequence_weights)
        surrogate = weight * surrogate
    loss = -weighted_mean(surrogate, mask, weights)
    with torch.no_grad():
        stats["clip_frac"] = weighted_mean(((ratio - 1.0).abs() > clip_coef).float(), mask, stat_weights)
        stats["ratio_mean"] = weighted_mean(ratio, mask, stat_weights)
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip_coef: float | None,
    mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """``0.5 * mean((V - R)^2)``; with ``clip_coef``, the pessimistic clipped form
    ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`` where ``old_values`` are
    the critic's values at the start of the update."""
    err = (values - returns).square()
    if clip_coef is not None:
        clipped = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
        err = torch.max(err, (clipped - returns).square())
    return 0.5 * weighted_mean(err, mask, weights)


def entropy_bonus(entropy: Tensor, coef: float, mask: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
    """The loss term ``-coef * mean(entropy)`` (negative: minimising it raises the entropy)."""
    return -coef * weighted_mean(entropy, mask, weights)


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
    """GAE over ``[B, G]`` response tokens: each sequence terminates at its last action token, so nothing
    bootstraps past it; advantages are 0 outside ``mask`` and whitened over it with ``normalize``. A mask
    with gaps (multi-turn episodes: observation tokens between the policy's turns) counts policy tokens
    only: each row's are gathered to its front, in order, so each one's next step is the next *policy*
    token (an observation is part of the transition), and the results go back to their columns; rewards
    outside ``mask`` are dropped (a turn's reward sits on its last policy token). A right-padded mask is
    gathered in place, no host read either way. Returns ``(advantages, returns)``, ``[B, G]``."""
    order = torch.argsort((mask <= 0).to(torch.int8), dim=1, stable=True)  # policy columns first, in order
    packed = torch.gather(mask, 1, order)
    rewards, values = torch.gather(rewards, 1, order), torch.gather(values, 1, order)
    # where each row ends, by scatter: one_hot would read the indices' range on the host
    end = torch.clamp(packed.sum(-1).long() - 1, min=0)
    last = torch.zeros(packed.shape, dtype=rewards.dtype, device=mask.device).scatter_(-1, end.unsqueeze(-1), 1.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    adv, returns = gae(rewards.T, values.T, next_values.T, last.T, last.T, gamma, lam)  # time-major
    adv, returns = adv.T * packed, returns.T
    adv = whiten(adv, mask=packed) if normalize else adv
    back = torch.empty_like(order).scatter_(1, order, torch.arange(mask.shape[1], device=mask.device).expand_as(order))
    return torch.gather(adv, 1, back), torch.gather(returns, 1, back)


# -- loss variants: group baselines, loss normalisation, adaptive KL, learning-rate schedule ---------

Advantage = Literal["grpo", "dr-grpo", "rloo"]
LossNorm = Literal["token", "sequence", "dr-grpo"]
LRSchedule = Literal["constant", "cosine"]


def group_advantages(score: Tensor, group_size: int, kind: Advantage = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-sample advantages ``[B] -> [B]`` from the scores of consecutive groups of ``group_size``
    samples of one prompt, with the group itself as the baseline:

    * ``grpo`` (Shao et al. 2024): ``(r_i - mean) / (std + eps)``, population std; a group whose
      scores are all equal gets 0 (no signal, no NaN);
    * ``dr-grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r_i - mean``; dividing
      by the std up-weights groups that are nearly all right or all wrong (a difficulty bias);
    * ``rloo`` (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean)``, the
      leave-one-out baseline, independent of the sample it scores (so the estimate stays unbiased).
    """
    g = score.float().view(-1, group_size)
    centred = g - g.mean(1, keepdim=True)
    if kind == "grpo":
        out = centred / (g.std(1, unbiased=False, keepdim=True) + eps)
    elif kind == "dr-grpo":
        out = centred
    elif kind == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs groups of >= 2 samples (the baseline is the others' mean)")
        out = g - (g.sum(1, keepdim=True) - g) / (group_size - 1)
    else:
        raise ValueError(f"advantage must be 'grpo', 'dr-grpo' or 'rloo', not {kind!r}")
    return out.view(-1)


def loss_weights(mask: Tensor | None, norm: LossNorm, like: Tensor) -> Tensor:
    """Per-element weights ``w`` (shape of ``like``, ``[n, G]`` for sequences) such that a loss
    ``sum(w * x)`` is the minibatch loss under normalisation ``norm``:

    * ``token``: ``m / sum(m)``, the mean over every valid token of the minibatch (what
      :func:`masked_mean` gives; long responses weigh more, as in DAPO);
    * ``sequence``: ``m / (len_i * n)``, each sequence's token mean, then the mean over sequences
      (the original GRPO; a token of a short response weighs more, the length bias Dr. GRPO removes);
    * ``dr-grpo``: ``m / (G * n)``, the tokens' sum over a constant (the padded response length G
      times the sequences), so no sequence's length rescales its tokens.

    Without a mask every element is valid and the three are the plain mean. Computed over the whole
    minibatch, they make micro-batches exact: the micro-batches' ``sum(w * x)`` add up to the
    minibatch's loss. An empty row or minibatch gets weight 0 (no NaN)."""
    if mask is None:
        return torch.full_like(like, 1.0 / max(like.numel(), 1))
    m = mask.to(like.dtype)
    if norm == "token":
        return m / m.sum().clamp_min(1.0)
    rows = max(m.shape[0], 1)
    if norm == "sequence":
        return m / (m.sum(-1, keepdim=True).clamp_min(1.0) * rows)
    if norm == "dr-grpo":
        return m / float(m[0].numel() * rows)
    raise ValueError(f"loss norm must be 'token', 'sequence' or 'dr-grpo', not {norm!r}")


def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The next KL coefficient of Ziegler et al. 2019's proportional controller (TRL's
    ``AdaptiveKLController``): ``e = clip(KL / target - 1, -0.2, 0.2)``, ``coef * (1 + e * n_steps /
    horizon)``. ``current_kl`` is the batch's mean KL to the reference per sequence (nats), ``n_steps``
    the sequences it came from; the clip bounds the change per sample, so a noisy batch moves it little."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def lr_at(update: int, lr: float, schedule: LRSchedule = "constant", warmup_updates: int = 0,
          decay_updates: int | None = None, min_lr_ratio: float = 0.0) -> float:
    """The learning rate of the 0-based ``update``: a linear warm-up ``lr * (update + 1) / warmup``
    over the first ``warmup_updates`` (so the first step is small, never 0), then ``constant`` or a
    ``cosine`` from ``lr`` down to ``min_lr_ratio * lr`` over ``decay_updates`` updates, staying there."""
    if update < warmup_updates:
        return lr * (update + 1) / warmup_updates
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"lr schedule must be 'constant' or 'cosine', not {schedule!r}")
    if not decay_updates:
        raise ValueError("the cosine schedule needs decay_updates >= 1")
    t = min(update - warmup_updates, decay_updates) / decay_updates
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))
