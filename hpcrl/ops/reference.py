"""Pure-torch references of every hpcrl._C op.

They define the semantics: the C++/CUDA kernels are tested against these, and ``hpcrl.ops`` falls
back to them when the extension is not built. Written for clarity, not speed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

TERMINATED = 1  # flags bit 0: episode ended, no bootstrap
TRUNCATED = 2  # flags bit 1: time limit, bootstrap from the stored final observation


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack same-dtype tensors into one 1-D tensor (in list order)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
    if out is None:
        return flat
    out.copy_(flat)
    return out


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Scatter ``flat`` back into ``tensors`` in place, multiplied by ``scale``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        chunk = flat[offset : offset + n].view_as(t)
        t.copy_(chunk if scale == 1.0 else (chunk.float() * scale).to(t.dtype))
        offset += n


class ReplayGather(NamedTuple):
    obs: torch.Tensor  # [B, D]
    action: torch.Tensor  # [B, A]
    reward: torch.Tensor  # [B] n-step discounted reward sum
    next_obs: torch.Tensor  # [B, D] bootstrap observation
    discount: torch.Tensor  # [B] gamma^k, 0 if the window ends in a termination
    n: torch.Tensor  # [B] int64 effective n (k)


def replay_gather(
    obs: torch.Tensor,
    action: torch.Tensor,
    reward: torch.Tensor,
    flags: torch.Tensor,
    final_ref: torch.Tensor,
    final_pool: torch.Tensor,
    head_next_obs: torch.Tensor,
    env_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    ptr: int,
    n_step: int,
    gamma: float,
) -> ReplayGather:
    """Gather rows of a time-major replay shard with n-step returns.

    Same semantics as ``csrc/common/replay_nstep.h``: a window stops after the first terminated or
    truncated step and never reaches the write head (logical time ``ptr``).
    """
    capacity, num_envs = reward.shape
    env = env_idx.long()
    slot = slot_idx.long()
    t = slot + capacity * torch.div(ptr - 1 - slot, capacity, rounding_mode="floor")
    available = ptr - t
    j = torch.arange(n_step, device=reward.device)
    slots = (slot[:, None] + j) % capacity  # [B, n]
    r = reward[slots, env[:, None]]
    f = flags[slots, env[:, None]].long()
    in_range = j[None, :] < available[:, None]
    # Step j is included if it is in range and no step before it ended the episode.
    ended_before = torch.cumsum((f != 0).long(), dim=1) - (f != 0).long()
    included = in_range & (ended_before == 0)
    k = included.sum(dim=1)
    ret = torch.zeros(len(env), dtype=torch.float32, device=reward.device)
    disc = torch.ones_like(ret)
    for step in range(n_step):  # sequential float32 accumulation, same order as the kernels
        inc = included[:, step]
        ret = torch.where(inc, ret + disc * r[:, step], ret)
        disc = torch.where(inc, disc * torch.tensor(gamma, dtype=torch.float32), disc)
    last = (slot + k - 1) % capacity
    last_flags = flags[last, env].long()
    disc = torch.where((last_flags & TERMINATED) != 0, torch.zeros_like(disc), disc)

    from_head = (t + k) == ptr
    from_final = ~from_head & (last_flags != 0)
    next_obs = obs[(last + 1) % capacity, env]
    pool_idx = final_ref[last, env].clamp(min=0)
    if final_pool.shape[0] > 0:
        next_obs = torch.where(from_final[:, None], final_pool[pool_idx], next_obs)
    next_obs = torch.where(from_head[:, None], head_next_obs[env], next_obs)
    return ReplayGather(obs[slot, env], action[slot, env], ret, next_obs, disc, k)
