"""The process groups (planes) of a detached-PPO world, decided identically on every rank.

* trainers: a host plane (metrics, stop agreement), a device plane (gradient all-reduce; NCCL when
  the trainers are on GPUs, each on its own) and a checkpoint plane (gloo: the checkpoint writer
  thread's DCP collectives, apart from the training thread's);
* weights: trainer 0 + every maker. NCCL when all of them are on CUDA and no two share a GPU
  (NCCL refuses two ranks of one communicator on one device — e.g. one node, one GPU, a trainer and a
  maker on it); otherwise gloo, with the weights staged through host memory;
* exchange: every rank, gloo, for credits and experience. Its receivers idle in posted receives
  (a credit backlog, a slow rollout), and a gloo timeout closes the connection, so this plane and the
  weight plane get :data:`hpcrl.comm.IDLE_TIMEOUT`: liveness is the heartbeats' job.

Each rank publishes where it runs (host, device, GPU UUID) through the store first, so the choice
needs no extra collective; GPUs are told apart by UUID, not by ``cuda:K`` (with one GPU per task every
task calls its GPU ``cuda:0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.comm import IDLE_TIMEOUT, DistContext, DistSetupError, Plane, new_plane, new_planes
from hpcrl.comm.shm import attach_shared_memory

from .topology import Topology
from .wire import share_placements

__all__ = ["RolePlanes", "make_role_planes", "weight_backend"]


@dataclass(frozen=True)
class RolePlanes:
    exchange: Plane
    """Credits and experience (every rank; a host plane)."""
    trainer_host: Plane
    trainer_device: Plane
    weights: Plane
    """Trainer 0 + makers; a device plane (NCCL) or a host plane (gloo, CPU staging)."""
    checkpoint: Plane
    """The trainers; a host plane only the checkpoint writer thread uses (DCP save and load)."""


Placement = tuple[str, str, str]  # (host, device, GPU UUID or "")


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _placements(ctx: DistContext) -> list[Placement]:
    assert ctx.store is not None
    record = f"{ctx.hostname}|{ctx.device}|{gpu_uuid(ctx.device)}"
    return [_placement(k, raw) for k, raw in share_placements(ctx.store, ctx.rank, ctx.world_size, record,
                                                              ctx.timeout)]


def _placement(key: str, raw: bytes) -> Placement:
    # host | device | UUID, each bounded: a malformed record (another program's key) is named, not unpacked
    parts = raw.decode("utf-8", errors="replace").split("|")
    if len(parts) != 3 or len(parts[0]) > 255 or not parts[1] or len(parts[1]) > 32 or len(parts[2]) > 64:
        raise DistSetupError(f"store key {key!r} holds {raw[:80]!r}, not a 'host|device|gpu-uuid' placement record")
    return parts[0], parts[1], parts[2]


def _gpu(p: Placement) -> tuple[str, str]:
    return p[0], p[2] or p[1]  # the physical GPU: UUID when known


def weight_backend(placements: list[Placement]) -> str:
    """``nccl`` iff every member is on CUDA and no two share a physical GPU; else ``gloo``."""
    cuda = all(device.startswith("cuda") for _, device, _ in placements)
    return "nccl" if cuda and len({_gpu(p) for p in placements}) == len(placements) else "gloo"


def make_role_planes(ctx: DistContext, top: Topology) -> RolePlanes:
    """Create every subgroup (collective over the whole world: every rank calls it, in this order)."""
    if not ctx.is_distributed:
        raise DistSetupError("detached PPO needs at least two ranks (one trainer, one maker)")
    where = _placements(ctx)
    trainers = where[: top.trainers]
    kinds = {device.split(":")[0] for _, device, _ in trainers}
    if len(kinds) > 1:
        raise DistSetupError(f"trainers resolved to different kinds of device ({', '.join(sorted(kinds))}): set "
                             "--trainer-device cpu or cuda explicitly, the same for every trainer")
    trainer_backend = "nccl" if kinds == {"cuda"} else "gloo"
    gpus = [_gpu(p) for p in trainers]
    if trainer_backend == "nccl" and len(set(gpus)) < len(gpus):
        shared = sorted({f"{where[r][0]} {where[r][1]}" for r in range(top.trainers) if gpus.count(gpus[r]) > 1})
        raise DistSetupError(f"trainers share a GPU ({', '.join(shared)}); NCCL refuses that: one trainer per "
                             "GPU (fewer --trainers, more GPUs), or --trainer-device cpu")
    trainer_ranks = list(range(top.trainers))
    t_host, t_device = new_planes(trainer_ranks, ctx.rank, ctx.device, trainer_backend, ctx.timeout)
    if ctx.host_plane.shm is not None:  # the world sums through shared memory: so do the trainers' CPU planes
        t_host, t_device = attach_shared_memory([t_host, t_device], ctx)
    exchange = new_plane("host", range(top.world_size), ctx.rank, ctx.device, "gloo", IDLE_TIMEOUT)

    weight_ranks = [0] + [top.maker_rank(m) for m in range(top.makers)]
    backend = weight_backend([where[r] for r in weight_ranks])
    # gloo weights travel as host tensors: the plane that carries them is a host plane
    weights = new_plane("device" if backend == "nccl" else "host", weight_ranks, ctx.rank, ctx.device, backend,
                        IDLE_TIMEOUT, eager=True)
    checkpoint = new_plane("host", trainer_ranks, ctx.rank, ctx.device, "gloo", ctx.timeout)
    return RolePlanes(exchange, t_host, t_device, weights, checkpoint)


def staging_note(planes: RolePlanes, device: torch.device) -> str:
    """How weights reach this rank, for the start-up line."""
    if planes.weights.backend == "nccl":
        return "weights by NCCL broadcast"
    return "weights by gloo broadcast" + (" (staged through host memory)" if device.type == "cuda" else "")
