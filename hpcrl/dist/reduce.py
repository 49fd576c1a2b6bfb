"""Packed collectives the trainers need: sums, broadcasts, metric means, a divergence check.

Each helper packs its tensors into one flat buffer so a call costs one collective (latency, not
bandwidth, dominates at these sizes). All are no-ops without a process group.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ._pack import pack, unpack_
from .context import DistContext

__all__ = [
    "RankDivergenceError",
    "all_reduce_sum_",
    "broadcast_",
    "check_parameters_in_sync",
    "reduce_metrics",
]

Scalar = float | int | torch.Tensor


class RankDivergenceError(RuntimeError):
    """Parameters that must be identical on every rank are not; ``diverged`` lists (rank, name)."""

    def __init__(self, message: str, diverged: list[tuple[int, str]]):
        super().__init__(message)
        self.diverged = diverged


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _comm_device(ctx: DistContext, group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo is fastest on host memory.
    return ctx.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce_sum_(tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None) -> None:
    """Sum each tensor over the ranks, in place, with one collective.

    Same-dtype tensors are packed natively (fused ops). Mixed dtypes (e.g. an int64 count beside
    float32 sums) are packed as float64, which holds float32/bf16 values and integers below 2**53
    exactly, so the single collective costs no accuracy. Tensors must share one device.
    """
    if not tensors or not _distributed(group):
        return
    if len({t.dtype for t in tensors}) == 1:
        flat = pack(tensors)
    else:
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat, group=group)
    unpack_(flat, tensors)


def broadcast_(tensors: Iterable[torch.Tensor], src: int = 0, *, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (one collective per dtype).

    For the start of a run and after a resume: parameters (passed as they are), target networks,
    log-alpha, normalizer statistics. Bit-exact for every dtype.
    """
    tensors = list(tensors)
    if not tensors or not _distributed(group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = pack(same)
        dist.broadcast(flat, src=src, group=group)
        unpack_(flat, same)


def reduce_metrics(
    metrics: Mapping[str, Scalar],
    ctx: DistContext,
    *,
    weights: Mapping[str, Scalar] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Mean of each metric over the ranks (one collective, one host sync); every rank gets the result.

    ``weights[name]`` turns that metric into a weighted mean, sum(w*v)/sum(w): e.g. an episode return
    weighted by the number of episodes each rank finished. A rank with weight 0 contributes nothing
    (its value may be NaN); if all weights are 0 the result is NaN. Every rank must pass the same
    metric names (checked).
    """
    if not metrics:
        return {}
    weights = weights or {}
    unknown = set(weights) - set(metrics)
    if unknown:
        raise KeyError(f"weights for unknown metrics {sorted(unknown)}")
    names = sorted(metrics)
    distributed = ctx.is_distributed and _distributed(group)
    device = _comm_device(ctx, group) if distributed else torch.device("cpu")

    def scalar(x: Scalar) -> torch.Tensor:
        t = x.detach() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
        return t.to(device=device, dtype=torch.float64).reshape(())

    w = torch.stack([scalar(weights.get(k, 1.0)) for k in names])
    v = torch.stack([scalar(metrics[k]) for k in names])
    name_sum = float(zlib.crc32("\0".join(names).encode()))  # exact in float64
    names_col = torch.tensor([name_sum], dtype=torch.float64, device=device)
    packed = torch.cat([torch.where(w > 0, w * v, 0.0), w, names_col])
    world = 1
    if distributed:
        dist.all_reduce(packed, group=group)
        world = dist.get_world_size(group)
    host = packed.tolist()
    if host[-1] != name_sum * world:
        raise ValueError(f"reduce_metrics: ranks passed different metric names (rank {ctx.rank}: {names})")
    n = len(names)
    out = [num / den if den > 0 else float("nan") for num, den in zip(host[:n], host[n : 2 * n])]
    return dict(zip(names, out))


def _checksums(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).to(torch.float64)
    # Sum and absolute sum catch changed values; the position-weighted sum also catches swaps.
    pos = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), x.abs().sum(), (x * pos).sum()])


def check_parameters_in_sync(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    ctx: DistContext,
    *,
    group: dist.ProcessGroup | None = None,
    max_report: int = 10,
) -> None:
    """Raise :class:`RankDivergenceError` on every rank if any tensor differs from rank 0's.

    Compares three float64 checksums per tensor (sum, |sum|, position-weighted sum), gathered in one
    collective; exact comparison, since data-parallel replicas must be bit-identical (NaN equals
    NaN here: a divergence check, not a finiteness check). Every rank must pass the same names,
    shapes and order, e.g. ``model.named_parameters()`` plus named buffers.
    """
    named = list(named_tensors)
    if not named or not ctx.is_distributed or not _distributed(group):
        return
    device = _comm_device(ctx, group)
    local = torch.stack([_checksums(t.to(device)) for _, t in named])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered).cpu()  # [world, tensors, 3]
    same = (table == table[0]) | (table.isnan() & table[0].isnan())
    bad = (~same.all(dim=2)).nonzero().tolist()
    if not bad:
        return
    diverged = [(r, named[i][0]) for r, i in bad]
    lines = [
        f"rank {r}: {named[i][0]!r} (sum {table[r, i, 0].item():.17g} vs {table[0, i, 0].item():.17g} on rank 0)"
        for r, i in bad[:max_report]
    ]
    more = f"\n  ... and {len(bad) - max_report} more" if len(bad) > max_report else ""
    ranks = sorted({r for r, _ in diverged})
    raise RankDivergenceError(
        f"parameters diverged from rank 0 on rank(s) {', '.join(map(str, ranks))}:\n  " + "\n  ".join(lines) + more,
        diverged,
    )
