"""Rank functions of tests/test_shm.py (importable by name: spawned ranks unpickle them)."""

from __future__ import annotations

import os
import time

import torch

import hpcrl.comm.shm as shm
from hpcrl.comm import init_distributed, shutdown

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def rank_data(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)) * 100
    return x.to(dtype)


def sums(slot_bytes: int, reference_wait: bool) -> dict:
    """Every dtype summed on both shared-memory planes and on gloo, a tensor of many slots included."""
    shm._SLOT_BYTES["device"] = slot_bytes  # small slots: one sum spans many rounds of both slot sets
    if reference_wait:
        shm._C = None  # the pure-Python wait (x86)
    ctx = init_distributed(timeout_s=60)
    plane, host = ctx.device_plane, ctx.host_plane
    out = {"context": str(ctx), "planes": [str(plane), str(host)], "sums": {}, "gloo": {}, "leftover": []}
    for dtype in DTYPES:
        for n in (1, 7, 40_000):
            mine = rank_data(ctx.rank, dtype, n)
            via_shm, via_host, via_gloo = mine.clone(), mine.clone(), mine.clone()
            plane.sum_(via_shm)
            host.sum_(via_host)
            torch.distributed.all_reduce(via_gloo, group=plane.group)
            assert torch.equal(via_shm, via_host)
            out["sums"][(str(dtype), n)] = via_shm
            out["gloo"][(str(dtype), n)] = via_gloo
    out["rounds"] = plane.shm.round if plane.shm is not None else 0
    # rank 0 created the segment in a scratch dir named after its pid: unlinked once every rank mapped it
    out["leftover"] = [e for e in os.listdir("/dev/shm") if f"-{os.getpid()}-" in e] if ctx.rank == 0 else []
    return out


def dead_peer() -> dict:
    """Rank 1 exits before the sum; rank 0 must name it, quickly."""
    ctx = init_distributed(timeout_s=60)
    if ctx.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        ctx.device_plane.sum_(torch.ones(10))
    except shm.SharedMemoryPeerError as err:
        shutdown(timeout_s=1, gone=[1])
        return {"error": str(err), "rank": err.rank, "s": time.monotonic() - t0}
    return {"error": "", "s": time.monotonic() - t0}


def late_peer() -> dict:
    """Rank 1 sleeps well past the 2 s timeout of the plane; rank 0 must name it after the timeout."""
    ctx = init_distributed(timeout_s=2)
    if ctx.rank == 1:
        time.sleep(8)
        return {}
    t0 = time.monotonic()
    try:
        ctx.host_plane.sum_(torch.ones(3))
    except shm.SharedMemoryPeerError as err:
        return {"error": str(err), "rank": err.rank, "s": time.monotonic() - t0}
    return {"error": "", "s": time.monotonic() - t0}


def switched_off() -> list[str]:
    ctx = init_distributed(timeout_s=30, shared_memory=False)
    names = [str(ctx), str(ctx.device_plane), str(ctx.host_plane)]
    shutdown()  # rank 0 holds the store: it leaves last (see ppo_trainer_planes)
    return names


def subgroup() -> dict:
    """Planes over ranks 1 and 2 of 3 (detached PPO's trainers are such a subgroup): only they take part."""
    from hpcrl.comm import new_planes
    from hpcrl.comm.shm import attach_shared_memory

    ctx = init_distributed(timeout_s=60)
    host, device = attach_shared_memory(list(new_planes([1, 2], ctx.rank, ctx.device, "gloo", ctx.timeout)), ctx)
    x = rank_data(ctx.rank, torch.float32, 1000)
    if device.active:
        device.sum_(x)
        host.sum_(x[:10])
    world_x = rank_data(ctx.rank, torch.float32, 10)
    ctx.device_plane.sum_(world_x)  # the world's segment still works beside the subgroup's
    shutdown()
    return {"planes": [str(host), str(device)], "x": x, "world": world_x}


def ppo_trainer_planes() -> list[str]:
    """Detached PPO's role planes for 2 trainers : 1 maker on one host."""
    from hpcrl.ppo.role_planes import make_role_planes
    from hpcrl.ppo.topology import Topology

    ctx = init_distributed(timeout_s=60, world_device_plane=False)
    planes = make_role_planes(ctx, Topology(trainers=2, makers=1))
    names = [str(planes.trainer_host), str(planes.trainer_device)]
    shutdown()  # rank 0 holds the store: leaving first broke a peer still connecting its last plane (seen once in CI)
    return names
