"""Pure-torch references of every hpcrl._C op.

They define the semantics: the C++/CUDA kernels are tested against these, and ``hpcrl.ops`` falls
back to them when the extension is not built. Written for clarity, not speed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
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


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counter: np.ndarray, seed: int) -> np.ndarray:
    """Philox4x32-10 of 64-bit ``counter`` values (words 2, 3 zero) under the 64-bit key ``seed``:
    [B, 4] uint32 words, as csrc/common/replay_sample.h (and torch's ``at::Philox4_32``) compute them."""
    lo32 = np.uint64(0xFFFFFFFF)
    c = [counter & lo32, counter >> np.uint64(32), np.zeros_like(counter), np.zeros_like(counter)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0 = np.uint64(_PHILOX_M[0]) * c[0]  # a 32 x 32-bit product fits uint64 exactly
        p1 = np.uint64(_PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & lo32, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & lo32]
        k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
    return np.stack(c, axis=1).astype(np.uint32)


def sample_pairs(seed: int, offset: int, batch: int, num_envs: int, capacity: int, ptr: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (env, slot) pairs of rows ``offset .. offset + batch`` of ``seed``'s stream: 64 Philox bits
    modulo the number of written pairs, mapped like :meth:`ReplayShard.sample`'s draw."""
    words = philox4x32_10(np.arange(offset, offset + batch, dtype=np.uint64), seed).astype(np.uint64)
    filled = min(ptr, capacity)
    i = ((words[:, 1] << np.uint64(32)) | words[:, 0]) % np.uint64(num_envs * filled)
    i = torch.from_numpy(i.astype(np.int64))
    return i % num_envs, (ptr - filled + i // num_envs) % capacity


def replay_sample(obs, action, reward, flags, final_ref, final_pool, head_next_obs, ptr: int, n_step: int,
                  gamma: float, seed: int, offset: int, batch: int) -> tuple[ReplayGather, torch.Tensor, torch.Tensor]:
    """Draw ``batch`` rows of ``seed``'s stream from ``offset`` on and gather them: the batch and its pairs."""
    capacity, num_envs = reward.shape
    env, slot = (t.to(reward.device) for t in sample_pairs(seed, offset, batch, num_envs, capacity, ptr))
    return replay_gather(obs, action, reward, flags, final_ref, final_pool, head_next_obs, env, slot, ptr, n_step,
                         gamma), env, slot
