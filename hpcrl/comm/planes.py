"""The two communication planes. Every collective and point-to-point call in hpcrl names one.

* **device plane** — tensors on the rank's device: gradients, weights, normaliser statistics,
  divergence checksums. NCCL when the ranks' devices are CUDA, gloo on CPU.
* **host plane** — always gloo, always CPU tensors: stop agreement, metrics rows, credits, headers,
  experience bytes, anything small and control-like.

Rules. No code uses the default process group implicitly: every helper of :mod:`hpcrl.comm` takes
a :class:`Plane`, and role subgroups (detached PPO's trainers, its weight group) are created as
planes too (:func:`new_planes`). Control values are CPU tensors from the start, so they never force
a device->host read inside an update loop (a log row may read the device; it happens once per row).

In production the world's device plane is the default group (one communicator fewer). With
``HPCRL_STRICT_PLANES=1`` the default group is initialised with a backend registered for CUDA only
(:data:`STRICT_BACKEND`), so any CPU tensor sent to it raises "No backend type associated with device
type cpu" — the failure a forgotten plane would hit under NCCL — while both planes are separate real
gloo groups. CPU CI runs its multi-rank tests in this mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .shm import SharedMemorySum

__all__ = ["IDLE_TIMEOUT", "Plane", "STRICT_BACKEND", "abort", "new_plane", "new_planes", "strict_planes"]

STRICT_BACKEND = "hpcrl_strict"  # registered for CUDA only: a CPU tensor on the default group raises
PlaneName = Literal["host", "device"]


def strict_planes() -> bool:
    """True when ``HPCRL_STRICT_PLANES=1``: the default group is poisoned for CPU tensors."""
    return os.environ.get("HPCRL_STRICT_PLANES", "") not in ("", "0")


def _strict_backend(store, rank, size, timeout):
    # Only CUDA tensors would ever reach this backend; gloo serves them correctly should any appear.
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def register_strict_backend() -> None:
    if not hasattr(dist.Backend, STRICT_BACKEND.upper()):
        dist.Backend.register_backend(STRICT_BACKEND, _strict_backend, devices=["cuda"])


@dataclass(frozen=True)
class Plane:
    """One process group and the device its tensors live on.

    ``ranks`` are the global ranks of the group in group-rank order. ``group`` is None for a plane of
    one rank (nothing to communicate: every helper is a no-op) and on ranks outside the group
    (``member`` False). ``backend`` is ``"nccl"`` or ``"gloo"`` (None without a group). ``shm``: the
    plane's shared-memory segment when all its ranks share a host (:mod:`hpcrl.comm.shm`): its sums go there.
    """

    name: PlaneName
    device: torch.device
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    backend: str | None = None
    member: bool = True
    shm: "SharedMemorySum | None" = field(default=None, compare=False)

    @classmethod
    def local(cls, name: PlaneName, device: torch.device | str = "cpu", rank: int = 0) -> "Plane":
        """A plane of one rank: no process group, every collective on it is a no-op."""
        return cls(name, torch.device(device), (rank,))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def active(self) -> bool:
        """A member of a group of more than one rank: collectives on this plane communicate."""
        return self.member and self.group is not None and self.size > 1

    def check(self, tensors: Sequence[torch.Tensor], what: str = "tensor") -> None:
        """Raise if a tensor is on the wrong kind of device for this plane (metadata only: no host read)."""
        for t in tensors:
            if t.device.type != self.device.type:
                raise ValueError(f"{what} on {t.device} sent on the {self.name} plane, whose tensors live on "
                                 f"{self.device} ({self.backend}); move it, or use the other plane")

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum one contiguous tensor over the plane's ranks, in place: through the shared-memory segment when
        the plane has one, else one all-reduce on its group. Collective; callers check :attr:`active`."""
        if self.shm is not None:
            self.shm.sum_(tensor)
        else:
            dist.all_reduce(tensor, group=self.group)

    def __str__(self) -> str:
        via = f"{self.backend}, shared memory" if self.shm is not None else self.backend or "no group"
        return f"{self.name} plane ({via}, {self.device}, ranks {list(self.ranks)})"


IDLE_TIMEOUT = timedelta(days=1)
"""For planes whose receivers idle in a posted receive (detached PPO's credits, experience, weight
headers): a gloo timeout closes the connection, so liveness is left to heartbeats instead."""


def new_plane(name: PlaneName, ranks: Sequence[int], rank: int, device: torch.device, backend: str,
              timeout: timedelta, eager: bool = False) -> Plane:
    """One plane over ``ranks``. Collective over the WHOLE world: every rank calls it, in the same
    order, with the same ``ranks`` and ``backend`` (a torch.distributed rule for ``new_group``).
    ``device``: where this rank's tensors for the plane live (a host plane's is always cpu).
    ``eager`` (NCCL, distinct GPUs checked): create the communicator now, on the calling thread,
    instead of inside the first collective (which may run on a background thread without a deadline)."""
    ranks = tuple(sorted(ranks))
    member = rank in ranks
    bind = device if eager and backend == "nccl" and member and device.type == "cuda" else None
    group = dist.new_group(list(ranks), timeout=timeout, backend=backend, device_id=bind)
    here = torch.device("cpu") if name == "host" or not member else device
    return Plane(name, here, ranks, group if member else None, backend, member)


def new_planes(ranks: Sequence[int], rank: int, device: torch.device, device_backend: str,
               timeout: timedelta) -> tuple[Plane, Plane]:
    """(host plane, device plane) over ``ranks``; see :func:`new_plane`."""
    return (new_plane("host", ranks, rank, device, "gloo", timeout),
            new_plane("device", ranks, rank, device, device_backend, timeout))


def abort(plane: Plane) -> None:
    """Give up on a plane whose collectives can no longer complete (a member died): abort its
    communicator so pending operations are dropped, not left to NCCL's watchdog (which would take the
    whole process down when they time out). Never use the plane afterwards."""
    if plane.group is None or plane.backend != "nccl":  # gloo has no watchdog: abandoned ops just error
        return
    try:
        dist.distributed_c10d._abort_process_group(plane.group)
    except Exception:  # best effort
        pass
