"""Run-directory checkpoints: one directory per checkpoint, committed by an atomic rename.

Layout: ``run_dir/checkpoints/step_<N>/`` holds ``learner.pt`` (global rank 0: networks,
optimisers, normaliser, counters, RNG) and ``rank<r>.h5`` (every rank: replay shard, env state,
RNG). Files are first written to ``.tmp-step_<N>/``; only when every rank has finished does rank 0
rename the directory, so a job killed mid-write never shadows the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from hpcrl.h5io import atomic_path, load_h5, save_h5

PREFIX = "step_"
FORMAT_VERSION = 1


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | os.PathLike, step: int, rank: int, world_size: int, learner: dict[str, Any] | None,
         rank_state: dict[str, Any], barrier: Callable[[str], None], keep: int = 2) -> Path:
    """Collective: every rank calls it with its own ``rank_state``; rank 0 also passes ``learner``."""
    root = checkpoint_root(run_dir)
    tmp = root / f".tmp-{PREFIX}{step:012d}"
    final = root / f"{PREFIX}{step:012d}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of a job killed while writing this very step
        tmp.mkdir(parents=True)
    barrier("ckpt-begin")
    save_h5(tmp / f"rank{rank}.h5", rank_state, FORMAT_VERSION)
    if rank == 0:
        assert learner is not None
        with atomic_path(tmp / "learner.pt") as path:
            torch.save(learner, path)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size}))
    barrier("ckpt-written")
    if rank == 0:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier("ckpt-committed")
    return final


def latest(run_dir: str | os.PathLike) -> Path | None:
    """Newest committed checkpoint directory, or None. Uncommitted ``.tmp-*`` directories are ignored."""
    root = checkpoint_root(run_dir)
    found = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "meta.json").exists()) if root.exists() else []
    return found[-1] if found else None


def load(path: Path, rank: int, world_size: int, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """(learner state, this rank's state). Raises if the checkpoint was made by another world size."""
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != world_size:
        raise ValueError(f"{path} was written by {meta['world_size']} ranks but this job has {world_size}; "
                         "resume with the same number of ranks (replay shards are per rank)")
    learner = torch.load(path / "learner.pt", map_location=device, weights_only=True)
    return learner, load_h5(path / f"rank{rank}.h5", FORMAT_VERSION)
