"""Replay shards in HDF5 (one file per rank), written atomically (temp file, fsync, rename)."""

from __future__ import annotations

import os

from hpcrl.core.h5io import load_h5, save_h5

from .shard import ReplayShard

FORMAT_VERSION = 1


def save_shard(shard: ReplayShard, path: str | os.PathLike) -> None:
    """Write ``shard`` to ``path``; a crash mid-write leaves any previous file at ``path`` intact."""
    save_h5(path, shard.state_dict(), FORMAT_VERSION)


def load_shard(shard: ReplayShard, path: str | os.PathLike) -> None:
    """Load a file written by :func:`save_shard` into ``shard`` (configurations must match)."""
    shard.load_state_dict(load_h5(path, FORMAT_VERSION))
