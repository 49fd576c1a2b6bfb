"""Observation normaliser whose statistics are reduced across ranks once per vector step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ObsNormalizer(nn.Module):
    """Running mean/variance (Chan's parallel merge, float64) of every observation the policy saw.

    ``update`` takes this rank's fresh observations and an ``all_reduce_sum`` callable; the
    (count, sum, sum of squares) of the batch are summed over ranks in ONE collective, so every rank
    holds identical statistics without a broadcast, and W ranks equal one rank fed all their rows.
    """

    def __init__(self, dim: int, eps: float = 1e-2, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.eps = eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("m2", torch.zeros(dim, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], None] | None = None) -> None:
        if not self.enabled:
            return
        stats = self.batch_stats(x)
        if all_reduce_sum is not None:
            all_reduce_sum(stats)
        self.merge(stats)

    @torch.no_grad()
    def batch_stats(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's (count, sum, sum of squares) of ``x`` as one float64 vector: summed over ranks
        (alone or packed with other such vectors), then :meth:`merge`."""
        x = x.to(torch.float64)
        # Shift by the running mean so the sum of squares does not cancel catastrophically.
        shifted = x - self.mean
        return torch.cat([torch.tensor([x.shape[0]], dtype=torch.float64, device=x.device),
                          shifted.sum(0), shifted.square().sum(0)])

    @torch.no_grad()
    def merge(self, stats: torch.Tensor) -> None:
        """Fold :meth:`batch_stats`, summed over the ranks, into the running statistics."""
        n, s, ss = stats[0], stats[1 : 1 + self.mean.numel()], stats[1 + self.mean.numel() :]
        batch_mean = s / n  # relative to the old mean
        batch_m2 = ss - n * batch_mean.square()
        total = self.count + n
        self.m2 += batch_m2 + batch_mean.square() * self.count * n / total
        self.mean += batch_mean * n / total
        self.count.copy_(total)

    @property
    def std(self) -> torch.Tensor:
        var = self.m2 / self.count.clamp(min=1)
        return var.sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        normalized = (x - self.mean.to(x.dtype)) / (self.std.to(x.dtype) + self.eps)
        return torch.where(self.count > 0, normalized, x)  # identity before the first update, no host read
