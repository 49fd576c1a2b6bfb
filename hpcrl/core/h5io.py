"""Nested dicts of tensors and scalars <-> HDF5 groups (h5py), written atomically through a file this
process owns (:func:`hpcrl.core.diskfault.owned_file`: a full disk is a :class:`~hpcrl.core.diskfault.DiskFault`)."""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np
import torch

from hpcrl.core.diskfault import owned_file
from hpcrl.core.rundir_files import atomic_path

_NONE = "__none__"


def write_tree(group: h5py.Group, tree: dict[str, Any]) -> None:
    """Tensors/arrays become datasets, nested dicts groups, scalars/strings/None attributes."""
    for key, value in tree.items():
        if isinstance(value, dict):
            write_tree(group.create_group(key), value)
        elif isinstance(value, torch.Tensor):
            data = value.detach().cpu()
            group.create_dataset(key, data=data.numpy() if data.dtype != torch.bfloat16 else data.float().numpy())
            group[key].attrs["torch_dtype"] = str(data.dtype).removeprefix("torch.")
        elif isinstance(value, np.ndarray):
            group.create_dataset(key, data=value)
        elif value is None:
            group.attrs[key] = _NONE
        elif isinstance(value, (bool, int, float, str, np.generic)):
            group.attrs[key] = value
        else:
            raise TypeError(f"write_tree: {key!r} has unsupported type {type(value).__name__}")


def read_tree(group: h5py.Group) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            tree[key] = read_tree(item)
        else:
            array = np.asarray(item)
            dtype = item.attrs.get("torch_dtype")
            tree[key] = torch.from_numpy(array).to(getattr(torch, dtype)) if dtype else array
    for key, value in group.attrs.items():
        if key == "format_version":
            continue
        if isinstance(value, str) and value == _NONE:
            tree[key] = None
        elif isinstance(value, np.generic):
            tree[key] = value.item()
        else:
            tree[key] = value
    return tree


def save_h5(path: str | os.PathLike, tree: dict[str, Any], format_version: int = 1) -> None:
    # HDF5 writes through our file object, never its own descriptor: every write error is ours to see
    with owned_file(path) as raw, h5py.File(raw, "w") as f:
        f.attrs["format_version"] = format_version
        write_tree(f, tree)


def load_h5(path: str | os.PathLike, format_version: int = 1) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        found = int(f.attrs.get("format_version", -1))
        if found != format_version:
            raise ValueError(f"{path}: format version {found}, expected {format_version}")
        return read_tree(f)
