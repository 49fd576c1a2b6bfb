"""Replay shards in HDF5 (one file per rank), written atomically: temp file, fsync, rename."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch

from .shard import ReplayShard

FORMAT_VERSION = 1


def save_shard(shard: ReplayShard, path: str | os.PathLike) -> None:
    """Write ``shard`` to ``path``; a crash mid-write leaves any previous file at ``path`` intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = FORMAT_VERSION
            for key, value in shard.state_dict().items():
                if isinstance(value, torch.Tensor):
                    f.create_dataset(key, data=value.detach().cpu().numpy())
                else:
                    f.attrs[key] = value
            f.flush()
            os.fsync(f.id.get_vfd_handle())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_shard(shard: ReplayShard, path: str | os.PathLike) -> None:
    """Load a file written by :func:`save_shard` into ``shard`` (configurations must match)."""
    with h5py.File(path, "r") as f:
        version = int(f.attrs.get("format_version", -1))
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: replay format version {version}, expected {FORMAT_VERSION}")
        state = {key: torch.from_numpy(np.asarray(f[key])) for key in f.keys()}
        state.update({key: f.attrs[key].item() if hasattr(f.attrs[key], "item") else f.attrs[key]
                      for key in f.attrs.keys() if key != "format_version"})
    shard.load_state_dict(state)
