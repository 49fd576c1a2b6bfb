"""Uniform minibatches of a :class:`ReplayShard` drawn and gathered in one kernel call.

Compared with :meth:`ReplayShard.sample` (``torch.randint`` and four index ops, then the gather into
fresh tensors): the (env, slot) pairs come from a counter-based RNG inside the kernel (Philox4x32-10
keyed by ``seed``; row b of the k-th batch is counter ``offset + b``), and every batch is written into
the same preallocated buffers, so a call allocates nothing (no page faults on a large heap). The state
that makes a stream reproducible is two integers, ``seed`` and ``offset``: :meth:`state_dict`.

A batch returned by :meth:`sample` is a view of the sampler's buffers: it is valid until the next
call (an update consumes it before drawing the next one; copy what must outlive it).
"""

from __future__ import annotations

import torch

from hpcrl import ops

from .shard import Batch, ReplayShard

__all__ = ["Sampler"]

_U64 = (1 << 64) - 1


class Sampler:
    def __init__(self, shard: ReplayShard, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"Sampler: batch_size={batch_size} must be >= 1")
        self.shard, self.batch_size = shard, int(batch_size)
        self.seed, self.offset = int(seed) & _U64, 0
        B, f32 = self.batch_size, dict(dtype=torch.float32, device=shard.device)
        self._out = (torch.empty(B, shard.row_dim, **f32), torch.empty(B, shard.action_dim, **f32),
                     torch.empty(B, **f32), torch.empty(B, shard.row_dim, **f32), torch.empty(B, **f32),
                     torch.empty(B, dtype=torch.int64, device=shard.device))
        self.env_idx = torch.empty(B, dtype=torch.int64, device=shard.device)  # the last batch's pairs
        self.slot_idx = torch.empty(B, dtype=torch.int64, device=shard.device)

    def sample(self) -> Batch:
        s = self.shard
        if s.ptr == 0:
            raise RuntimeError("sample: the replay shard is empty; add() transitions first")
        g = ops.replay_sample(s.obs, s.action, s.reward, s.flags, s.final_ref, s.final_pool, s.head_next_obs,
                              s.ptr, s.n_step, s.gamma, self.seed, self.offset, self.env_idx, self.slot_idx,
                              out=self._out)
        self.offset += self.batch_size
        return s.split(g)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The preallocated tensors every batch is written into (what a batch's tensors view)."""
        return self._out

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.offset = int(state["seed"]) & _U64, int(state["offset"])
