"""What a rank knows about its place in the job, as returned by :func:`hpcrl.comm.init_distributed`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from .planes import Plane

__all__ = ["DistContext", "DistSetupError", "Source"]

Source = Literal["torchrun", "local", "slurm", "mpi", "single"]  # local: hpcrl.comm.spawn / --nproc


class DistSetupError(RuntimeError):
    """The launcher environment is incomplete or inconsistent, or the rendezvous failed."""


@dataclass(frozen=True)
class DistContext:
    """One rank's view of the job.

    ``backend`` (the device plane's) is None and ``is_distributed`` False when there is no process
    group (world size 1: no collective is ever needed). ``host_plane`` / ``device_plane`` span the
    world (see :mod:`hpcrl.comm.planes`); with one rank they are planes of one. ``store`` is the
    rendezvous key-value store (a namespace of it that torch's own keys cannot collide with);
    :func:`hpcrl.comm.barrier` uses it.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    is_distributed: bool
    source: Source
    timeout: timedelta
    hostname: str = ""
    host_plane: Plane = field(default_factory=lambda: Plane.local("host"), repr=False, compare=False)
    device_plane: Plane = field(default_factory=lambda: Plane.local("device"), repr=False, compare=False)
    store: dist.Store | None = field(default=None, repr=False, compare=False)
    # Per-name barrier generations; identical on every rank because barriers are called in order.
    barrier_generations: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one rank that logs and writes shared files."""
        return self.rank == 0

    def rank_seed(self, seed: int) -> int:
        """Seed for rank-local randomness (envs, sampling): ``seed + rank``. Model init uses ``seed``."""
        return seed + self.rank

    def __str__(self) -> str:
        comm = self.backend or "no process group"
        if self.device_plane.shm is not None:
            comm += " + shared memory"
        where = f"local {self.local_rank} on {self.hostname or '?'}"
        return f"rank {self.rank}/{self.world_size} ({where}), {self.device}, {comm}, via {self.source}"
