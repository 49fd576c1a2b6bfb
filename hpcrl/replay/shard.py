"""Rank-local, per-env replay ring with n-step returns computed at sample time.

Storage layout (time-major: one ``add`` writes one contiguous block per field)::

    obs           [C, E, D] f32  observation the action was taken from (D = obs_dim + critic_obs_dim)
    action        [C, E, A] f32
    reward        [C, E]    f32  } views of one env-major [E, C] array of 8-byte steps (f32 reward, u8 flags,
    flags         [C, E]    u8   } 3 bytes padding); flags: bit 0 terminated, bit 1 truncated (termination wins)
    final_ref     [C, E]    i64  row of final_pool holding the true final observation, -1 if none
    final_pool    [P, D]    f32  ring of final observations of finished episodes, grown on demand
    head_next_obs [E, D]    f32  next observation of the newest transition

C = ``capacity`` slots per env, E = ``num_envs``. Every observation is stored once: the next
observation of slot t is ``obs[t + 1]``, except for the newest transition (``head_next_obs``) and for
transitions that ended an episode (their true final observation, which the env replaced by a reset
observation, lives in ``final_pool``). That is about half the memory of storing obs and next_obs
(docs/holosoma.md#replay-storage). The contract this relies on: for envs that did not finish, the ``obs``
passed to the next ``add`` equals this ``next_obs`` (true of every auto-resetting vector env).

Rewards and flags are the exception to time-major: they are stored env-major and side by side, so that
an n-step window (n consecutive steps of one env, which the sampler reads for every row) is one cache
line or two instead of 2n; ``reward`` and ``flags`` are [C, E] views of them, and checkpoints hold them
as [C, E] arrays like the other fields.

Privileged critic observations (``critic_obs_dim > 0``) are stored as extra columns of the same rows:
``obs[..., :obs_dim]`` is the actor's observation and ``obs[..., obs_dim:]`` the critic's, so they follow
the same layout rules (each stored once, final observations in ``final_pool``) and one fused gather
serves both; :class:`Batch` splits them again. With ``critic_obs_dim == 0`` the storage is exactly the
actor-only layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from hpcrl import ops
from hpcrl.ops.reference import TERMINATED, TRUNCATED, ReplayGather


class Batch(NamedTuple):
    """A sampled batch: ``ReplayGather``'s fields plus the privileged critic observations (None when
    the shard stores none)."""

    obs: torch.Tensor  # [B, obs_dim]
    action: torch.Tensor  # [B, A]
    reward: torch.Tensor  # [B] n-step discounted reward sum
    next_obs: torch.Tensor  # [B, obs_dim] bootstrap observation
    discount: torch.Tensor  # [B] gamma^k, 0 if the window ends in a termination
    n: torch.Tensor  # [B] int64 effective n (k)
    critic_obs: torch.Tensor | None = None  # [B, critic_obs_dim]
    next_critic_obs: torch.Tensor | None = None  # [B, critic_obs_dim] bootstrap critic observation

    @property
    def q_obs(self) -> torch.Tensor:
        """What the critic reads at s: the critic observation when there is one, else the actor's."""
        return self.obs if self.critic_obs is None else self.critic_obs

    @property
    def q_next_obs(self) -> torch.Tensor:
        return self.next_obs if self.next_critic_obs is None else self.next_critic_obs


class ReplayShard:
    """Replay ring of one rank: ``num_envs`` parallel envs, ``capacity`` transitions per env."""

    def __init__(
        self,
        num_envs: int,
        capacity: int,
        obs_dim: int,
        action_dim: int,
        n_step: int = 1,
        gamma: float = 0.99,
        device: torch.device | str = "cpu",
        critic_obs_dim: int = 0,
    ) -> None:
        for name, value in (("num_envs", num_envs), ("capacity", capacity), ("obs_dim", obs_dim),
                            ("action_dim", action_dim), ("n_step", n_step)):
            if int(value) < 1:
                raise ValueError(f"ReplayShard: {name}={value} must be >= 1")
        if int(critic_obs_dim) < 0:
            raise ValueError(f"ReplayShard: critic_obs_dim={critic_obs_dim} must be >= 0 (0 = none)")
        self.critic_obs_dim = int(critic_obs_dim)
        if n_step > capacity:
            raise ValueError(f"ReplayShard: n_step={n_step} exceeds capacity={capacity} slots per env")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"ReplayShard: gamma={gamma} must be in [0, 1]")
        self.num_envs, self.capacity = int(num_envs), int(capacity)
        self.obs_dim, self.action_dim = int(obs_dim), int(action_dim)
        self.n_step, self.gamma = int(n_step), float(gamma)
        self.device = torch.device(device)
        C, E, f32 = self.capacity, self.num_envs, dict(dtype=torch.float32, device=self.device)
        self.row_dim = self.obs_dim + self.critic_obs_dim  # stored columns per observation
        self.obs = torch.zeros(C, E, self.row_dim, **f32)
        self.action = torch.zeros(C, E, self.action_dim, **f32)
        steps = torch.zeros(E, C, 2, **f32)  # [..., 0] reward, byte 4 of each step the flags
        self.reward = steps[..., 0].t()
        self.flags = steps.view(torch.uint8)[..., 4].t()
        self._steps = steps
        self.final_ref = torch.full((C, E), -1, dtype=torch.int64, device=self.device)
        self.final_pool = torch.zeros(E, self.row_dim, **f32)  # grows; E rows = one episode end per env
        self.head_next_obs = torch.zeros(E, self.row_dim, **f32)
        self.ptr = 0  # add() calls so far; the newest transition has logical time ptr - 1
        # final_pool is a ring: live entries are the `_pool_live` rows before `_pool_cursor`. Entries are
        # allocated and retired in time order, so they always form one contiguous run.
        self._pool_cursor = 0
        self._pool_live = 0
        self._pool_per_slot = [0] * C  # entries allocated by the write that last filled each slot

    def __len__(self) -> int:
        """Number of stored transitions (all envs)."""
        return self.num_envs * min(self.ptr, self.capacity)

    def nbytes(self) -> int:
        tensors = (self.obs, self.action, self._steps, self.final_ref, self.final_pool, self.head_next_obs)
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- writing -----------------------------------------------------------------------------------

    def add(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        terminated: torch.Tensor,
        truncated: torch.Tensor,
        critic_obs: torch.Tensor | None = None,
        next_critic_obs: torch.Tensor | None = None,
    ) -> None:
        """Append one env step of every env.

        ``next_obs`` is the observation that followed the action: the true final observation for envs
        whose episode ended (not the reset observation); ``critic_obs``/``next_critic_obs`` (required
        exactly when the shard has ``critic_obs_dim > 0``) follow the same rule. Costs one host read
        (the number of finished episodes, to size the final-observation pool).
        """
        E = self.num_envs
        self._check("obs", obs, (E, self.obs_dim))
        self._check("action", action, (E, self.action_dim))
        self._check("reward", reward, (E,))
        self._check("next_obs", next_obs, (E, self.obs_dim))
        self._check("terminated", terminated, (E,))
        self._check("truncated", truncated, (E,))
        if self.critic_obs_dim:
            if critic_obs is None or next_critic_obs is None:
                raise ValueError(f"ReplayShard.add: the shard stores critic observations (critic_obs_dim="
                                 f"{self.critic_obs_dim}); pass critic_obs and next_critic_obs")
            self._check("critic_obs", critic_obs, (E, self.critic_obs_dim))
            self._check("next_critic_obs", next_critic_obs, (E, self.critic_obs_dim))
            obs = torch.cat([obs.float(), critic_obs.float()], -1)
            next_obs = torch.cat([next_obs.float(), next_critic_obs.float()], -1)
        elif critic_obs is not None or next_critic_obs is not None:
            raise ValueError("ReplayShard.add: critic observations given but the shard has critic_obs_dim=0")
        term, trunc = terminated.bool(), truncated.bool() & ~terminated.bool()
        slot = self.ptr % self.capacity

        # Retire the final observations of the transitions this write overwrites.
        if self.ptr >= self.capacity:
            self._pool_live -= self._pool_per_slot[slot]
        ended = term | trunc
        num_ended = int(ended.sum())
        self._reserve_pool(self._pool_live + num_ended)
        self.final_ref[slot] = -1
        if num_ended:
            rows = (self._pool_cursor + torch.arange(num_ended, device=self.device)) % self.final_pool.shape[0]
            self.final_pool[rows] = next_obs[ended].float()
            self.final_ref[slot, ended] = rows
            self._pool_cursor = (self._pool_cursor + num_ended) % self.final_pool.shape[0]
            self._pool_live += num_ended
        self._pool_per_slot[slot] = num_ended

        self.obs[slot] = obs
        self.action[slot] = action
        self.reward[slot] = reward
        self.flags[slot] = term.to(torch.uint8) * TERMINATED + trunc.to(torch.uint8) * TRUNCATED
        self.head_next_obs.copy_(next_obs)
        self.ptr += 1

    def _reserve_pool(self, needed: int) -> None:
        size = self.final_pool.shape[0]
        if needed <= size:
            return
        # Grow geometrically and compact the live run to rows [0, live) so refs stay one ring.
        new_size = max(2 * size, needed)
        start = (self._pool_cursor - self._pool_live) % size
        live_rows = (start + torch.arange(self._pool_live, device=self.device)) % size
        pool = torch.zeros(new_size, self.row_dim, dtype=torch.float32, device=self.device)
        pool[: self._pool_live] = self.final_pool[live_rows]
        has_ref = self.final_ref >= 0
        self.final_ref = torch.where(has_ref, (self.final_ref - start) % size, self.final_ref)
        self.final_pool = pool
        self._pool_cursor = self._pool_live

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ReplayShard.add: {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"ReplayShard.add: {name} has shape {tuple(t.shape)}, expected {shape} "
                             f"(num_envs={self.num_envs}, obs_dim={self.obs_dim}, action_dim={self.action_dim})")
        if t.device != self.device:
            raise ValueError(f"ReplayShard.add: {name} is on {t.device} but the shard is on {self.device}")

    # -- reading -----------------------------------------------------------------------------------

    def gather(self, env_idx: torch.Tensor, slot_idx: torch.Tensor) -> Batch:
        """Rows at (env, physical slot) pairs, with n-step reward sum, bootstrap obs and discount.

        ``discount = gamma**k`` (k = effective n) or 0 if the window ends in a termination; the
        TD target is ``reward + discount * V(next_obs)``.
        """
        env_idx = torch.as_tensor(env_idx, dtype=torch.int64, device=self.device).reshape(-1)
        slot_idx = torch.as_tensor(slot_idx, dtype=torch.int64, device=self.device).reshape(-1)
        if env_idx.shape != slot_idx.shape:
            raise ValueError(f"gather: env_idx has {env_idx.numel()} rows, slot_idx {slot_idx.numel()}")
        if self.ptr == 0:
            raise RuntimeError("gather: the replay shard is empty; add() transitions first")
        filled = min(self.ptr, self.capacity)
        if env_idx.numel() and (int(env_idx.min()) < 0 or int(env_idx.max()) >= self.num_envs):
            raise IndexError(f"gather: env_idx must be in [0, {self.num_envs})")
        if slot_idx.numel() and (int(slot_idx.min()) < 0 or int(slot_idx.max()) >= filled):
            raise IndexError(f"gather: slot_idx must be in [0, {filled}) (slots written so far)")
        return self._gather(env_idx, slot_idx)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Batch:
        """``batch_size`` transitions drawn uniformly (with replacement) over all stored (env, slot) pairs."""
        if self.ptr == 0:
            raise RuntimeError("sample: the replay shard is empty; add() transitions first")
        if batch_size < 1:
            raise ValueError(f"sample: batch_size={batch_size} must be >= 1")
        filled = min(self.ptr, self.capacity)
        i = torch.randint(self.num_envs * filled, (batch_size,), generator=generator, device=self.device)
        env_idx = i % self.num_envs
        slot_idx = (self.ptr - filled + torch.div(i, self.num_envs, rounding_mode="floor")) % self.capacity
        return self._gather(env_idx, slot_idx)

    def _gather(self, env_idx: torch.Tensor, slot_idx: torch.Tensor) -> Batch:
        return self.split(ops.replay_gather(self.obs, self.action, self.reward, self.flags, self.final_ref,
                                            self.final_pool, self.head_next_obs, env_idx, slot_idx, self.ptr,
                                            self.n_step, self.gamma))

    def split(self, g: ReplayGather) -> Batch:
        """A gathered batch as :class:`Batch`: stored rows split into actor and critic columns."""
        if not self.critic_obs_dim:
            return Batch(*g)
        D = self.obs_dim  # split the stored rows: actor columns, then critic columns (views, no copy)
        return Batch(g.obs[:, :D], g.action, g.reward, g.next_obs[:, :D], g.discount, g.n,
                     g.obs[:, D:], g.next_obs[:, D:])

    # -- persistence -------------------------------------------------------------------------------

    _RING = ("obs", "action", "reward", "flags", "final_ref")  # [capacity, num_envs, ...], filled from slot 0
    _CONFIG = ("num_envs", "capacity", "obs_dim", "action_dim", "n_step", "gamma", "critic_obs_dim")

    def state_dict(self) -> dict[str, Any]:
        """The shard's state holding only what is filled: the ring's first ``min(ptr, capacity)`` time
        slots (time-major: the ring fills from slot 0, so that prefix is every written slot), the
        final-observation pool and the write head; :meth:`load_state_dict` restores full capacity, bit-identical."""
        filled = min(self.ptr, self.capacity)
        state: dict[str, Any] = {name: getattr(self, name)[:filled].contiguous() for name in self._RING}
        state.update(final_pool=self.final_pool, head_next_obs=self.head_next_obs)
        state.update({name: getattr(self, name) for name in self._CONFIG})
        state.update(ptr=self.ptr, pool_cursor=self._pool_cursor, pool_live=self._pool_live,
                     pool_per_slot=torch.tensor(self._pool_per_slot, dtype=torch.int64))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (one holding the whole capacity, as older checkpoints do, too)."""
        for name in self._CONFIG:
            mine, theirs = getattr(self, name), state.get(name, 0)  # shards older than critic obs: 0
            if (float(mine) != float(theirs)):
                raise ValueError(f"load_state_dict: saved shard has {name}={theirs}, this shard has {name}={mine}; "
                                 "build the shard with the saved configuration")
        filled = min(int(state["ptr"]), self.capacity)
        for name in self._RING:
            saved = torch.as_tensor(state[name])
            if saved.shape[0] not in (filled, self.capacity) or saved.shape[1:] != getattr(self, name).shape[1:]:
                raise ValueError(f"load_state_dict: saved {name} has shape {tuple(saved.shape)}, expected "
                                 f"{filled} or {self.capacity} time slots of {tuple(getattr(self, name).shape[1:])}")
            full = getattr(self, name)
            full[filled:] = -1 if name == "final_ref" else 0  # never-written slots, as a fresh shard has them
            full[:filled].copy_(saved[:filled])
        for name in ("final_pool", "head_next_obs"):
            setattr(self, name, torch.as_tensor(state[name]).to(self.device).clone())
        self.ptr = int(state["ptr"])
        self._pool_cursor = int(state["pool_cursor"])
        self._pool_live = int(state["pool_live"])
        self._pool_per_slot = [int(x) for x in torch.as_tensor(state["pool_per_slot"]).tolist()]
