"""Barrier timeout, divergence check and packed reductions on an initialized 2-rank group."""

from __future__ import annotations

import torch
from torch import nn

from hpcrl.comm import (
    BarrierTimeoutError,
    DistContext,
    RankDivergenceError,
    all_reduce_sum_,
    barrier,
    broadcast_,
    check_replicas_equal,
    reduce_metrics,
)


def run(ctx: DistContext) -> dict:
    out: dict = {"rank": ctx.rank, "source": ctx.source, "backend": ctx.backend}
    # Reused barrier names must keep working (generations, key cleanup).
    for _ in range(4):
        barrier(ctx, "repeat", timeout_s=10)

    # Packed sum with mixed dtypes: one collective.
    count = torch.tensor([ctx.rank + 1], dtype=torch.int64)
    total = torch.full((3,), 0.5 * (ctx.rank + 1))
    all_reduce_sum_([count, total], ctx.device_plane)
    out["count"], out["total"] = count.clone(), total.clone()

    # Broadcast from rank 0 (a parameter, float32 + int64).
    w = nn.Parameter(torch.full((2, 2), float(ctx.rank)))
    steps = torch.tensor([10 * (ctx.rank + 1)])
    broadcast_([w, steps], ctx.device_plane)
    out["bcast"] = (w.detach().clone(), steps.clone())

    # Metrics: plain means, and a weighted mean where rank 1 finished no episode (NaN value).
    ret = float("nan") if ctx.rank == 1 else -200.0
    out["metrics"] = reduce_metrics(
        {"loss": torch.tensor(float(ctx.rank)), "episode_return": ret, "sps": 100.0 * (ctx.rank + 1)},
        ctx.host_plane,
        weights={"episode_return": 0.0 if ctx.rank == 1 else 3.0},
    )
    out["reductions"] = reduce_metrics({"samples": 10.0 * (ctx.rank + 1), "lag_max": float(ctx.rank),
                                        "lag_min": float(ctx.rank), "loss": float(ctx.rank)},
                                       ctx.host_plane, sums=["samples"], maxes=["lag_max"], mins=["lag_min"])
    out["wrong_plane"] = []
    for call in (lambda: all_reduce_sum_([count], ctx.host_plane.__class__("device", torch.device("cuda"),
                                                                             ctx.device_plane.ranks,
                                                                             ctx.device_plane.group, "nccl")),
                 lambda: reduce_metrics({"x": 1.0}, ctx.device_plane)):
        try:
            call()
        except ValueError as err:
            out["wrong_plane"].append(str(err))

    # Divergence check: identical replicas pass, a perturbed tensor on rank 1 is named.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    check_replicas_equal(net.named_parameters(), ctx.device_plane)
    if ctx.rank == 1:
        with torch.no_grad():
            net[2].bias[1] += 1e-6
    try:
        check_replicas_equal(net.named_parameters(), ctx.device_plane)
        out["divergence"] = None
    except RankDivergenceError as err:
        out["divergence"] = (str(err), err.diverged)

    # Barrier timeout: rank 1 never arrives at "lonely" (it goes on to shutdown).
    if ctx.rank == 0:
        try:
            barrier(ctx, "lonely", timeout_s=1.5)
            out["barrier"] = None
        except BarrierTimeoutError as err:
            out["barrier"] = (str(err), err.missing)
    return out
