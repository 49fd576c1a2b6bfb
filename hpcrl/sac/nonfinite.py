"""Non-finite env data (``--nonfinite error | skip``): detect it with one host read per vector step, stop
every rank with one message, or replace the affected transitions by "nothing happened"."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hpcrl.comm import DistContext
from hpcrl.core.config_check import DataError

from .config import SACConfig

_NONFINITE_KEY = "sac/nonfinite/{rank}"


class NonFiniteEnvData(DataError):
    """The env returned a NaN/inf reward or observation (``--nonfinite error``); the message (one line)
    names the env, the rank, the vector step, the quantity and the fix. Not a configuration error."""


def count_bad(result: Any, critic: bool) -> int:
    """Envs whose step holds a NaN/inf. One reduction and one host read: a NaN/inf anywhere in reward,
    next_obs or obs makes its env's sum non-finite (so does a float overflow, which is unusable data
    too). The read lands just before replay.add's own host read (the finished-episode count), which
    then finds the queue drained."""
    total = result.reward + result.next_obs.sum(-1) + result.obs.sum(-1)
    if critic:
        total = total + result.critic_obs.sum(-1) + result.next_critic_obs.sum(-1)
    return int((~torch.isfinite(total)).sum())


def post(ctx: DistContext, message: str) -> None:
    """Leave this rank's message where every rank finds it after the step's stop agreement."""
    ctx.store.set(_NONFINITE_KEY.format(rank=ctx.rank), message)


def posted(ctx: DistContext) -> str:
    """The message the lowest rank that found non-finite env data posted before the agreement."""
    for r in range(ctx.world_size):
        key = _NONFINITE_KEY.format(rank=r)
        if ctx.store.check([key]):
            return ctx.store.get(key).decode(errors="replace")[:2000]
    return "another rank found non-finite env data (its message did not reach the store)"


def message(cfg: SACConfig, rank: int, step: int, result: Any, bad: int) -> str:
    # The error path only: find what was non-finite (host reads do not matter any more).
    parts = []
    for name, t in (("reward", result.reward), ("next observation", result.next_obs), ("observation", result.obs)):
        finite = torch.isfinite(t) if t.dim() == 1 else torch.isfinite(t).all(-1)
        if not bool(finite.all()):
            idx = int((~finite).nonzero()[0, 0])
            value = t[idx] if t.dim() == 1 else t[idx][~torch.isfinite(t[idx])][0]
            parts.append(f"{name} ({float(value)} in env {idx} of the rank)")
    what = ", ".join(parts) or "sum of reward and observations (overflow)"
    return (f"env {cfg.env!r} returned a non-finite {what} on rank {rank} at vector step {step} "
            f"({bad} env(s) affected); fix the env, or pass --nonfinite skip to replace such transitions and count "
            "them (nonfinite_dropped)")


def sanitize(result: Any, obs: torch.Tensor, critic_obs: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """--nonfinite skip: the affected envs' transition becomes "nothing happened" (reward 0, the next
    observation is the one it acted on), so no NaN reaches the replay, the normaliser or the episode
    stats; returns (result, the observation to act on next). Critic observations alike."""
    reward_ok = torch.isfinite(result.reward)
    next_ok = torch.isfinite(result.next_obs).all(-1, keepdim=True)
    obs_ok = torch.isfinite(result.obs).all(-1, keepdim=True)
    reward = torch.where(reward_ok & next_ok.squeeze(-1), result.reward, torch.zeros_like(result.reward))
    fixed = dataclasses.replace(result, reward=reward, next_obs=torch.where(next_ok, result.next_obs, obs),
                                obs=torch.where(obs_ok, result.obs, obs))
    if critic_obs is not None:
        c_next_ok = torch.isfinite(result.next_critic_obs).all(-1, keepdim=True)
        c_ok = torch.isfinite(result.critic_obs).all(-1, keepdim=True)
        fixed = dataclasses.replace(
            fixed, reward=torch.where(c_next_ok.squeeze(-1), fixed.reward, torch.zeros_like(fixed.reward)),
            next_critic_obs=torch.where(c_next_ok, result.next_critic_obs, critic_obs),
            critic_obs=torch.where(c_ok, result.critic_obs, critic_obs))
    return fixed, fixed.obs
