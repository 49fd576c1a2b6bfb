"""Data-parallel gradient equivalence: 2 ranks with half batches vs 1 rank with the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.comm import DistContext, GradAverager, Plane
from hpcrl.comm.shm import SharedMemorySum

STEPS = 3
BATCH = 8  # global; each of W ranks takes BATCH // W rows


def make_model(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Parameter]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.SiLU(), nn.Linear(16, 1)).to(dtype)
    log_alpha = nn.Parameter(torch.zeros((), dtype=dtype))  # a bare parameter outside any module
    return net, log_alpha


def batch(step: int, rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g).to(dtype)
    y = torch.randn(BATCH, 1, generator=g).to(dtype)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(mode: str, rank: int, world: int, dtype: torch.dtype = torch.float32, plane: Plane | None = None) -> dict:
    """STEPS AdamW updates; returns the averaged grads of step 0, the final params and bookkeeping."""
    net, log_alpha = make_model(dtype)
    params = [*net.parameters(), log_alpha]
    averager = GradAverager(params, mode, plane=plane or Plane.local("device"))
    model = averager.wrap(net)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    calls = {"n": 0}
    real_all_reduce, real_shm_sum = dist.all_reduce, SharedMemorySum.sum_

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    def counting_shm_sum(*args, **kwargs):  # a same-host plane sums through shared memory, not gloo
        calls["n"] += 1
        return real_shm_sum(*args, **kwargs)

    out: dict = {"collectives": [], "zero_copy": []}
    for step in range(STEPS):
        # Step 1 uses torch's default zero_grad(set_to_none=True): view mode must survive it.
        if step == 1:
            opt.zero_grad(set_to_none=True)
        else:
            averager.zero_grad()
        ptrs = [p.grad.data_ptr() if p.grad is not None else None for p in params]
        x, y = batch(step, rank, world, dtype)
        loss = (model(x) - y).pow(2).mean() + log_alpha.exp() * x.mean()
        loss.backward()
        out["zero_copy"].append(all(p.grad.data_ptr() == q for p, q in zip(params, ptrs)))
        dist.all_reduce, SharedMemorySum.sum_ = counting_all_reduce, counting_shm_sum
        try:
            calls["n"] = 0
            averager.all_reduce()
        finally:
            dist.all_reduce, SharedMemorySum.sum_ = real_all_reduce, real_shm_sum
        out["collectives"].append(calls["n"])
        if step == 0:
            out["grads"] = [p.grad.detach().clone() for p in params]
        opt.step()
    out["params"] = [p.detach().clone() for p in params]
    return out


def run(ctx: DistContext) -> dict:
    plane = ctx.device_plane
    results = {mode: train(mode, ctx.rank, ctx.world_size, plane=plane) for mode in ("flat", "view", "ddp")}
    for mode in ("flat", "view"):
        results[f"{mode}-bf16"] = train(mode, ctx.rank, ctx.world_size, torch.bfloat16, plane)
    return results
