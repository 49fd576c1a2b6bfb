"""One PPO update for every workload: epochs x minibatches of the clipped policy, value, entropy (and
KL-to-reference) losses, each minibatch ``zero_grad -> backward -> average -> clip -> step``.

A workload supplies what differs (see :func:`ppo_update`): the tensors fixed at the update's start
(:class:`Samples`, sample dim first) and its forward pass over a minibatch of sample indices
(:class:`Outputs`). The loss math is :mod:`hpcrl.ppo.losses`. Stats stay device tensors through the
loop (no host read between minibatches); :func:`read_stats` makes the update's one host read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .losses import (ISLevel, ISMode, LossNorm, approx_kl, entropy_bonus, loss_weights, policy_loss, row_weights,
                     value_loss, weighted_mean)
from .workload import PPOConfig

__all__ = ["Coefs", "GradStep", "Outputs", "Plan", "Samples", "micro_batches", "minibatch_indices", "ppo_losses",
           "ppo_update", "read_stats", "token_micro_batches"]


@dataclass(frozen=True)
class Samples:
    """The update's per-sample tensors, computed without gradients at its start; dim 0 is the sample
    (an env step ``[n]``, or a sequence ``[n, G]`` of token-level values)."""

    behaviour_logp: Tensor
    advantages: Tensor
    old_values: Tensor | None = None
    """The critic's values at the start; None: no critic, no value loss (GRPO)."""
    returns: Tensor | None = None
    proximal_logp: Tensor | None = None
    """Given: decoupled PPO around the policy at the start (``cfg.truncated_is``)."""
    ref_logp: Tensor | None = None
    """Given: a KL-to-reference loss term (``Coefs.kl``; GRPO)."""
    mask: Tensor | None = None
    """Token mask ``[n, G]``; None: every element counts."""

    def __getitem__(self, idx: Tensor) -> Samples:
        return Samples(**{f.name: None if (v := getattr(self, f.name)) is None else v[idx] for f in fields(self)})


@dataclass(frozen=True)
class Outputs:
    """The forward pass over one minibatch, with gradients: log-probs of the taken actions, the
    policy's entropy there, and the critic's values (None without a critic); shapes of :class:`Samples`."""

    logp: Tensor
    entropy: Tensor
    values: Tensor | None = None


@dataclass(frozen=True)
class Coefs:
    """Loss coefficients of one update (``PPOConfig``'s, the clip coefficient maybe annealed)."""

    clip: float
    truncated_is: float | None = None
    value_clip: float | None = None
    vf: float = 0.5
    ent: float = 0.0
    kl: float = 0.0
    is_level: ISLevel = "token"
    """Rollout correction's granularity with a proximal policy (``PPOConfig.is_level``)."""
    is_mode: ISMode = "truncate"
    """Truncate or mask the rollout-correction weight at ``truncated_is`` (``PPOConfig.is_mode``)."""

    @classmethod
    def of(cls, cfg: PPOConfig, clip: float | None = None) -> Coefs:
        return cls(cfg.clip_coef if clip is None else clip, cfg.truncated_is, cfg.value_clip_coef, cfg.vf_coef,
                   cfg.ent_coef, cfg.kl_coef, cfg.is_level, cfg.is_mode)


@dataclass(frozen=True)
class Plan:
    """Minibatches: ``epochs`` passes, each a fresh permutation of the samples cut into ``minibatches``
    pieces, by ``tensor_split`` (sizes differ by at most one) or ``chunk`` (equal ceil-sized pieces
    and a shorter last one, maybe fewer pieces)."""

    epochs: int
    minibatches: int
    split: Literal["tensor_split", "chunk"] = "chunk"


@runtime_checkable
class ShardedGradAverage(Protocol):
    """A gradient averager whose gradients are shards (fsdp): it clips by their global norm itself."""

    def all_reduce(self) -> None: ...

    def clip_grad_norm_(self, params: list[Tensor], max_norm: float) -> Tensor: ...


@dataclass
class GradStep:
    """One optimizer step on a loss; ``grad_average.all_reduce()`` averages the gradients over the
    trainers (a no-op on one). Returns the gradient norm before clipping. Calling it is
    :meth:`zero_grad`, :meth:`backward`, :meth:`finish`; gradient accumulation calls
    :meth:`backward` once per micro-batch in between."""

    optimizer: torch.optim.Optimizer
    params: list[Tensor]
    grad_average: Any
    max_grad_norm: float

    def __call__(self, loss: Tensor) -> Tensor:
        self.zero_grad()
        self.backward(loss)
        return self.finish()

    def zero_grad(self) -> None:
        # set_to_none=False keeps GradAverager's "view" grads attached to its flat buffer
        self.optimizer.zero_grad(set_to_none=False)

    def backward(self, loss: Tensor) -> None:
        """Accumulate ``loss``'s gradients (one micro-batch's share of the minibatch loss)."""
        loss.backward()

    def finish(self) -> Tensor:
        """Average over the trainers, clip, step: once per minibatch, after its micro-batches."""
        self.grad_average.all_reduce()
        if isinstance(self.grad_average, ShardedGradAverage):
            norm = self.grad_average.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            norm = nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        return norm


def minibatch_indices(n: int, plan: Plan, generator: torch.Generator, device: torch.device) -> list[Tensor]:
    """One epoch's minibatches of sample indices (the permutation drawn on ``generator``'s device)."""
    perm = torch.randperm(n, generator=generator, device=generator.device).to(device)
    if plan.split == "tensor_split":
        return list(perm.tensor_split(plan.minibatches))
    return list(perm.chunk(plan.minibatches))


def ppo_losses(out: Outputs, s: Samples, c: Coefs,
               weights: tuple[Tensor, ...] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The minibatch loss ``policy + vf * value - ent * entropy (+ kl * KL to the reference)`` and its
    stats (detached): the loss terms, ``entropy``, ``approx_kl`` (k3 of the current policy against the
    ratio's anchor: the proximal policy, else the behaviour one) and :func:`policy_loss`'s stats.

    ``weights``: ``(loss, stat)`` weights of :func:`~hpcrl.ppo.losses.loss_weights` (the loss's
    normalisation, the token mean for the stats), and a third, :func:`~hpcrl.ppo.losses.row_weights` (the
    mean over sequences of the sequence-level rollout stats) where ``c.is_level`` is not ``token``; cut from
    the whole minibatch's when ``s`` is one micro-batch of it; None: means over ``s.mask``."""
    w, sw, rw = (None, None, None) if weights is None else (*weights, None)[:3]
    pl, pstats = policy_loss(out.logp, s.behaviour_logp, s.advantages, c.clip, c.truncated_is, s.proximal_logp,
                             mask=s.mask, weights=w, stat_weights=sw, is_level=c.is_level, is_mode=c.is_mode,
                             sequence_weights=rw)
    loss, stats = pl, {"policy_loss": pl}
    if s.old_values is not None:
        vl = value_loss(out.values, s.old_values, s.returns, c.value_clip, mask=s.mask, weights=w)
        loss, stats["value_loss"] = loss + c.vf * vl, vl
    loss = loss + entropy_bonus(out.entropy, c.ent, s.mask, w)
    if s.ref_logp is not None:
        kl = weighted_mean(approx_kl(out.logp, s.ref_logp), s.mask, w)
        loss, stats["kl_loss"] = loss + c.kl * kl, kl
    with torch.no_grad():
        anchor = s.behaviour_logp if s.proximal_logp is None else s.proximal_logp
        stats["entropy"] = weighted_mean(out.entropy, s.mask, sw)
        stats["approx_kl"] = weighted_mean(approx_kl(anchor, out.logp), s.mask, sw)
    stats.update(pstats)
    return loss, {k: v.detach() for k, v in stats.items()}


def micro_batches(n: int, size: int | None) -> list[slice]:
    """Consecutive slices of at most ``size`` of a minibatch of ``n`` samples (one slice: all of it)."""
    if not size or size >= n:
        return [slice(0, n)]
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def token_micro_batches(rows: list[int], budget: int, cost: Callable[[list[int]], int],
                        size: int | None = None) -> list[slice]:
    """Consecutive slices of ``rows`` (a minibatch's sample indices, in order) whose forward costs at most
    ``budget`` tokens by ``cost(samples)`` (and holds at most ``size`` samples): each piece grows while the
    next sample still fits; a sample over the budget alone runs alone."""
    pieces, start = [], 0
    for end in range(1, len(rows) + 1):
        full = size is not None and end - start > size
        if end - start > 1 and (full or cost(rows[start:end]) > budget):
            pieces.append(slice(start, end - 1))
            start = end - 1
    return pieces + [slice(start, len(rows))] if rows else [slice(0, 0)]


def _cut(idx: Tensor, key: Tensor | None, size: int | None, tokens: int | None,
         cost: Callable[[list[int]], int] | None) -> tuple[Tensor, list[slice]]:
    """A minibatch's indices ordered by ``key`` (when given), and its pieces: by ``tokens`` of ``cost``
    (and at most ``size`` samples) or by ``size`` alone (one piece without either)."""
    if key is not None:
        idx = idx[key[idx].argsort(stable=True)]  # on the device: no host read
    if tokens is not None:
        return idx, token_micro_batches(idx.tolist(), tokens, cost, size)
    return idx, micro_batches(idx.shape[0], size)


def _minibatch_step(forward: Callable[[Tensor], Outputs], idx: Tensor, mb: Samples, pieces: list[slice],
                    weights: tuple[Tensor, ...] | None, coefs: Coefs, step: GradStep,
                    want_gap: bool) -> tuple[dict[str, Tensor], Tensor | None]:
    """One optimizer step over minibatch ``mb`` (sample indices ``idx``): a forward / backward per piece, their
    gradients accumulated. Returns the minibatch's stats (weighted pieces: their sum; ``*_max``: their max)
    with ``grad_norm``, and with ``want_gap`` the mean ``|log pi_trainer - log pi_behaviour|`` before the step."""
    stats: dict[str, Tensor] = {}
    gap = None
    step.zero_grad()
    for piece in pieces:
        part = mb[piece] if weights is not None else mb
        w = None if weights is None else tuple(x[piece] for x in weights)
        out = forward(idx[piece])
        loss, piece_stats = ppo_losses(out, part, coefs, w)
        if want_gap:
            g = weighted_mean((out.logp.detach() - part.behaviour_logp).abs(), part.mask, None if w is None else w[1])
            gap = g if gap is None else gap + g
        step.backward(loss)
        for k, v in piece_stats.items():
            stats[k] = _combine(stats.get(k), k, v)
    stats["grad_norm"] = step.finish().detach()
    return stats, gap


def _combine(acc: Tensor | None, key: str, v: Tensor) -> Tensor:
    """Accumulate stat ``key``: a sum, or the running max of a ``*_max`` stat."""
    if acc is None:
        return v
    return torch.maximum(acc, v) if key.endswith("_max") else acc + v


def ppo_update(forward: Callable[[Tensor], Outputs], samples: Samples, coefs: Coefs, plan: Plan, step: GradStep,
               generator: torch.Generator, stats_dtype: torch.dtype | None = None,
               logp_gap: bool = False, micro_batch_size: int | None = None,
               loss_norm: LossNorm = "token", piece_key: Tensor | None = None,
               micro_batch_tokens: int | None = None,
               piece_cost: Callable[[list[int]], int] | None = None) -> dict[str, Tensor]:
    """Run ``plan`` over ``samples``: for each minibatch ``idx``, ``forward(idx)`` -> :func:`ppo_losses`
    -> ``step``. Returns each stat's mean over the minibatches as a device tensor (summed in
    ``stats_dtype``, default the stat's own; a ``*_max`` stat: the max over them), plus ``grad_norm``;
    with ``logp_gap`` also ``maker_logp_gap``, the mean ``|log pi_trainer - log pi_behaviour|`` over the first
    minibatch before any step (staleness + numerics between maker and trainer).

    ``micro_batch_size``: each minibatch runs as forward / backward passes over consecutive pieces
    of at most that many samples, their gradients accumulated before the one step; the loss weights
    (:func:`~hpcrl.ppo.losses.loss_weights` under ``loss_norm``) are the whole minibatch's, so the
    step equals the one on the whole minibatch (to float rounding) whatever the pieces' sizes.
    ``piece_key`` (``[n]``, e.g. sequence lengths): with micro-batches, each minibatch's samples are
    ordered by it before they are cut into pieces (sequences of like length share a piece, so a
    forward that trims padding trims more); a minibatch is a set, so this changes no number but rounding.
    ``micro_batch_tokens``: pieces cut by a token budget instead (or as well), ``piece_cost(sample
    indices)`` being what a forward over them computes (:func:`token_micro_batches`; a host read of the
    minibatch's indices each)."""
    n = samples.behaviour_logp.shape[0]
    sums: dict[str, Tensor] = {}
    steps = 0
    gap = None
    if micro_batch_tokens is not None and piece_cost is None:
        raise ValueError("ppo_update: micro_batch_tokens needs piece_cost (the tokens a forward over samples costs)")
    cut = bool(micro_batch_size) or micro_batch_tokens is not None
    weighted = cut or loss_norm != "token"
    for _ in range(plan.epochs):
        for idx in minibatch_indices(n, plan, generator, samples.behaviour_logp.device):
            idx, pieces = _cut(idx, piece_key if cut else None, micro_batch_size, micro_batch_tokens, piece_cost)
            mb = samples[idx]
            weights = None
            if weighted:
                weights = (loss_weights(mb.mask, loss_norm, mb.behaviour_logp),
                           loss_weights(mb.mask, "token", mb.behaviour_logp))
                if coefs.is_level != "token" and mb.mask is not None:  # sequence-level stats: a mean over rows
                    weights += (row_weights(mb.mask, mb.behaviour_logp),)
            mb_stats, first_gap = _minibatch_step(forward, idx, mb, pieces, weights, coefs, step,
                                                  logp_gap and steps == 0)
            gap = first_gap if steps == 0 else gap
            for k, v in mb_stats.items():
                v = v if stats_dtype is None else v.to(stats_dtype)
                sums[k] = _combine(sums.get(k), k, v) if k in sums else v.clone()
            steps += 1
    means = {k: v if k.endswith("_max") else v / steps for k, v in sums.items()}
    if gap is not None:
        means["maker_logp_gap"] = gap
    return means


def read_stats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Device scalars to floats in one host read (float64 holds every float32 value exactly)."""
    if not stats:
        return {}
    device = next(iter(stats.values())).device
    values = torch.stack([v.detach().reshape(()).to(device, torch.float64) for v in stats.values()])
    return dict(zip(stats, values.cpu().tolist()))
