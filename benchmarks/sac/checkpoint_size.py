#!/usr/bin/env python
"""A FastSAC rank's replay checkpoint early in a run, at holosoma's sizes: bytes written vs the ring's capacity.

    python benchmarks/sac/checkpoint_size.py [--envs 4096] [--slots 1024] [--steps 50] [--json PATH]

One rank holding holosoma's 4096 envs x 1024 slots (obs 100, actions 29, as its humanoid tasks), filled
with ``--steps`` vector steps, saved with the checkpoint's own writer (only the filled slots are written).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import write_json  # noqa: E402
from hpcrl.replay import ReplayShard  # noqa: E402
from hpcrl.replay.hdf5 import save_shard  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--obs-dim", type=int, default=100)
    ap.add_argument("--action-dim", type=int, default=29)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=str(RESULTS / "checkpoint_size.json"))
    args = ap.parse_args()
    envs, done = args.envs, torch.zeros(args.envs, dtype=torch.bool)
    shard = ReplayShard(envs, args.slots, obs_dim=args.obs_dim, action_dim=args.action_dim, n_step=1, gamma=0.97)
    obs = torch.randn(envs, args.obs_dim)
    for _ in range(args.steps):
        nxt = torch.randn(envs, args.obs_dim)
        shard.add(obs, torch.rand(envs, args.action_dim), torch.randn(envs), nxt, done, done)
        obs = nxt
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "shard.h5")
        t0 = time.perf_counter()
        save_shard(shard, path)
        seconds, written = time.perf_counter() - t0, os.path.getsize(path)
    capacity = shard.nbytes()
    config = {k: getattr(args, k) for k in ("envs", "slots", "obs_dim", "action_dim", "steps")}
    doc = schema.make("checkpoint_size", schema.header("cpu", 1, config),
                      {"written_mb": schema.figure(written / 1e6, "MB", False),
                       "capacity_mb": schema.figure(capacity / 1e6, "MB", False),
                       "write_s": schema.figure(seconds, "s", False)}, {})
    write_json(args.json, doc)
    print(f"checkpoint_size: {args.envs} envs x {args.slots} slots after {args.steps} vector steps: "
          f"{written / 1e6:.1f} MB written ({seconds:.2f} s) instead of the {capacity / 1e6:.1f} MB capacity; {args.json}")


if __name__ == "__main__":
    main()
