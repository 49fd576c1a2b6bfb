"""Packed collectives the trainers need: sums, broadcasts, metric means, a divergence check.

Each helper packs its tensors into one flat buffer so a call costs one collective (latency, not
bandwidth, dominates at these sizes), and names its plane (:mod:`hpcrl.comm.planes`): sums,
broadcasts and checksums run where their tensors live (the device plane), metrics on the host
plane. All are no-ops on a plane of one rank.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ._pack import pack, unpack_
from .planes import Plane

__all__ = [
    "RankDivergenceError",
    "all_reduce_sum_",
    "broadcast_",
    "check_replicas_equal",
    "reduce_metrics",
]

Scalar = float | int | torch.Tensor


class RankDivergenceError(RuntimeError):
    """Parameters that must be identical on every rank are not; ``diverged`` lists (rank, name)."""

    def __init__(self, message: str, diverged: list[tuple[int, str]]):
        super().__init__(message)
        self.diverged = diverged


def all_reduce_sum_(tensors: Sequence[torch.Tensor], plane: Plane) -> None:
    """Sum each tensor over the ranks, in place, with one collective.

    Same-dtype tensors are packed natively (fused ops). Mixed dtypes (e.g. an int64 count beside
    float32 sums) are packed as float64, which holds float32/bf16 values and integers below 2**53
    exactly, so the single collective costs no accuracy. Tensors must share one device, the plane's kind.
    """
    if not tensors or not plane.active:
        return
    plane.check(tensors)
    if len({t.dtype for t in tensors}) == 1:
        flat = pack(tensors)
    else:
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    plane.sum_(flat)
    unpack_(flat, tensors)


def broadcast_(tensors: Iterable[torch.Tensor], plane: Plane, src: int | None = None) -> None:
    """Overwrite ``tensors`` on every rank with global rank ``src``'s values (default: the plane's first
    rank), one collective per dtype.

    For the start of a run and after a resume: parameters (passed as they are), target networks,
    log-alpha, normalizer statistics. Bit-exact for every dtype.
    """
    tensors = list(tensors)
    if not tensors or not plane.active:
        return
    plane.check(tensors)
    src = plane.ranks[0] if src is None else src
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = pack(same)
        dist.broadcast(flat, src=src, group=plane.group)
        unpack_(flat, same)


def reduce_metrics(
    metrics: Mapping[str, Scalar],
    plane: Plane,
    *,
    weights: Mapping[str, Scalar] | None = None,
    sums: Iterable[str] = (),
    maxes: Iterable[str] = (),
    mins: Iterable[str] = (),
) -> dict[str, float]:
    """Mean of each metric over the ranks of a host plane (one gloo collective; device tensors are
    copied to the host once, which is the row's one host read); every rank gets the result.

    ``weights[name]`` turns that metric into a weighted mean, sum(w*v)/sum(w): e.g. an episode return
    weighted by the number of episodes each rank finished. A rank with weight 0 contributes nothing
    (its value may be NaN); if all weights are 0 the result is NaN. Every rank must pass the same
    metric names (checked). Metrics named in ``sums`` are summed over the ranks instead (counts,
    samples, seconds), those in ``maxes`` / ``mins`` take the extreme over the ranks (a second
    collective, only when asked for); a weight does not apply to them.
    """
    if plane.name != "host":
        raise ValueError(f"reduce_metrics runs on the host plane, got the {plane}")
    if not metrics:
        return {}
    weights = weights or {}
    sums, maxes, mins = set(sums), set(maxes), set(mins)
    _check_reductions(metrics, [sums, maxes, mins, set(weights)])
    extremes = sorted(maxes) + sorted(mins)
    names = sorted(set(metrics) - set(extremes))
    empty = torch.zeros(0, dtype=torch.float64)
    w = torch.stack([_scalar(weights.get(k, 1.0)) for k in names]) if names else empty
    v = torch.stack([_scalar(metrics[k]) for k in names]) if names else empty
    name_sum = float(zlib.crc32("\0".join(names).encode()))  # exact in float64
    names_col = torch.tensor([name_sum], dtype=torch.float64)
    packed = torch.cat([torch.where(w > 0, w * v, 0.0), w, names_col])
    world = 1
    if plane.active:
        plane.sum_(packed)
        world = plane.size
    host = packed.tolist()
    if host[-1] != name_sum * world:
        raise ValueError(f"reduce_metrics: ranks passed different metric names (this rank: {names})")
    n = len(names)
    out = dict(zip(names, [num if k in sums else (num / den if den > 0 else float("nan"))
                           for k, num, den in zip(names, host[:n], host[n : 2 * n])]))
    if extremes:
        out.update(_reduce_extremes(metrics, sorted(maxes), sorted(mins), plane))
    return out


def _scalar(x: Scalar) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
    return t.to(device=torch.device("cpu"), dtype=torch.float64).reshape(())


def _check_reductions(metrics: Mapping[str, Scalar], special: list[set[str]]) -> None:
    """``special`` (summed, maxed, minned, weighted names) name known metrics, each at most once."""
    unknown = set().union(*special) - set(metrics)
    if unknown:
        raise KeyError(f"reductions named for unknown metrics {sorted(unknown)}")
    if sum(len(x) for x in special) != len(set().union(*special)):
        raise ValueError("a metric may be summed, maxed, minned or weighted, not several of them")


def _reduce_extremes(metrics: Mapping[str, Scalar], maxes: list[str], mins: list[str], plane: Plane
                     ) -> dict[str, float]:
    """Max of ``maxes`` and min of ``mins`` over the plane in one MAX collective (mins negated)."""
    extremes = maxes + mins
    sign = [1.0] * len(maxes) + [-1.0] * len(mins)
    ext = torch.stack([_scalar(metrics[k]) * s for k, s in zip(extremes, sign)])
    if plane.active:
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=plane.group)
    return {k: v * s for k, v, s in zip(extremes, ext.tolist(), sign)}


def _checksums(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).to(torch.float64)
    # Sum and absolute sum catch changed values; the position-weighted sum also catches swaps.
    pos = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), x.abs().sum(), (x * pos).sum()])


def check_replicas_equal(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    plane: Plane,
    *,
    max_report: int = 10,
) -> None:
    """Raise :class:`RankDivergenceError` on every rank if any tensor differs from rank 0's.

    Compares three float64 checksums per tensor (sum, |sum|, position-weighted sum), gathered in one
    collective; exact comparison, since data-parallel replicas must be bit-identical (NaN equals
    NaN here: a divergence check, not a finiteness check). Every rank must pass the same names,
    shapes and order, e.g. ``model.named_parameters()`` plus named buffers.
    """
    named = list(named_tensors)
    if not named or not plane.active:
        return
    local = torch.stack([_checksums(t.to(plane.device)) for _, t in named])
    gathered = [torch.empty_like(local) for _ in range(plane.size)]
    dist.all_gather(gathered, local, group=plane.group)
    table = torch.stack(gathered).cpu()  # [world, tensors, 3]
    same = (table == table[0]) | (table.isnan() & table[0].isnan())
    bad = (~same.all(dim=2)).nonzero().tolist()
    if not bad:
        return
    diverged = [(plane.ranks[r], named[i][0]) for r, i in bad]
    lines = [
        f"rank {plane.ranks[r]}: {named[i][0]!r} (sum {table[r, i, 0].item():.17g} vs {table[0, i, 0].item():.17g} on rank 0)"
        for r, i in bad[:max_report]
    ]
    more = f"\n  ... and {len(bad) - max_report} more" if len(bad) > max_report else ""
    ranks = sorted({plane.ranks[r] for r, _ in diverged})
    raise RankDivergenceError(
        f"parameters diverged from rank 0 on rank(s) {', '.join(map(str, ranks))}:\n  " + "\n  ".join(lines) + more,
        diverged,
    )
