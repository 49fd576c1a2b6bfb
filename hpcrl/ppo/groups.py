"""The process groups (planes) of a detached-PPO world, decided identically on every rank.

* trainers: a host plane (metrics, stop agreement) and a device plane (gradient all-reduce; NCCL when
  the trainers are on GPUs, each on its own);
* weights: trainer 0 + every maker. NCCL when all of them are on CUDA and no two share a GPU
  (NCCL refuses two ranks of one communicator on one device — e.g. one node, one GPU, a trainer and a
  maker on it); otherwise gloo, with the weights staged through host memory;
* credits and experience use the world's host plane (``ctx.host_plane``).

Each rank publishes ``host|device`` through the store first, so the choice needs no extra collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.comm import DistContext, DistSetupError, Plane, new_plane, new_planes

from .topology import Topology

__all__ = ["Groups", "make_groups", "weight_backend"]


@dataclass(frozen=True)
class Groups:
    world_host: Plane
    """Credits and experience (every rank)."""
    trainer_host: Plane
    trainer_device: Plane
    weights: Plane
    """Trainer 0 + makers; a device plane (NCCL) or a host plane (gloo, CPU staging)."""


def _placements(ctx: DistContext) -> list[tuple[str, str]]:
    assert ctx.store is not None
    ctx.store.set(f"ppo/device/{ctx.rank}", f"{ctx.hostname}|{ctx.device}")
    keys = [f"ppo/device/{r}" for r in range(ctx.world_size)]
    ctx.store.wait(keys, ctx.timeout)
    return [tuple(ctx.store.get(k).decode().split("|", 1)) for k in keys]  # type: ignore[misc]


def weight_backend(placements: list[tuple[str, str]]) -> str:
    """``nccl`` iff every member is on CUDA and no two share a (host, GPU); else ``gloo``."""
    cuda = all(device.startswith("cuda") for _, device in placements)
    return "nccl" if cuda and len(set(placements)) == len(placements) else "gloo"


def make_groups(ctx: DistContext, top: Topology) -> Groups:
    """Create every subgroup (collective over the whole world: every rank calls it, in this order)."""
    if not ctx.is_distributed:
        raise DistSetupError("detached PPO needs at least two ranks (one trainer, one maker)")
    where = _placements(ctx)
    trainers = where[: top.trainers]
    kinds = {device.split(":")[0] for _, device in trainers}
    if len(kinds) > 1:
        raise DistSetupError(f"trainers resolved to different kinds of device ({', '.join(sorted(kinds))}): set "
                             "--trainer-device cpu or cuda explicitly, the same for every trainer")
    trainer_backend = "nccl" if kinds == {"cuda"} else "gloo"
    if trainer_backend == "nccl" and len(set(trainers)) < len(trainers):
        shared = sorted({p for p in trainers if trainers.count(p) > 1})
        raise DistSetupError(f"two trainers share a GPU ({', '.join('|'.join(p) for p in shared)}); NCCL refuses "
                             "that: one trainer per GPU (fewer --trainers, more GPUs), or --trainer-device cpu")
    trainer_ranks = list(range(top.trainers))
    t_host, t_device = new_planes(trainer_ranks, ctx.rank, ctx.device, trainer_backend, ctx.timeout)

    weight_ranks = [0] + [top.maker_rank(m) for m in range(top.makers)]
    backend = weight_backend([where[r] for r in weight_ranks])
    # gloo weights travel as host tensors: the plane that carries them is a host plane
    weights = new_plane("device" if backend == "nccl" else "host", weight_ranks, ctx.rank, ctx.device, backend,
                        ctx.timeout)
    return Groups(ctx.host_plane, t_host, t_device, weights)


def staging_note(groups: Groups, device: torch.device) -> str:
    """How weights reach this rank, for the start-up line."""
    if groups.weights.backend == "nccl":
        return "weights by NCCL broadcast"
    return "weights by gloo broadcast" + (" (staged through host memory)" if device.type == "cuda" else "")
