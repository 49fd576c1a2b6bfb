"""Rank 1 raises; rank 0 is left waiting in a collective and must be killed by spawn."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpcrl.comm import init_distributed


def main() -> None:
    ctx = init_distributed(timeout_s=60)
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1), group=ctx.host_plane.group)  # never completes: rank 1 is gone
