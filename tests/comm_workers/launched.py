"""Entry point for ranks started by a launcher (fake Slurm env, mpiexec): prints one JSON line."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hpcrl.comm import init_distributed, shutdown

if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=30)
    x = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(x, group=ctx.host_plane.group)
    line = json.dumps({"rank": ctx.rank, "world": ctx.world_size, "local_rank": ctx.local_rank,
                       "source": ctx.source, "backend": ctx.backend, "sum": x.item()}) + "\n"
    os.write(1, line.encode())  # one write: ranks sharing a stdout pipe cannot interleave mid-line
    shutdown(timeout_s=15)
