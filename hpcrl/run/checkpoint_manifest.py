"""A checkpoint's manifest: the layout names, each file's size and CRC-32, and reading and checking them.

``manifest.json`` records step, world size, the run's identity and every file's size and CRC-32;
:func:`read_manifest` checks its structure, :func:`verify` the files against it. Anything wrong is a
:class:`CorruptCheckpoint` (one checkpoint unusable), a :class:`CheckpointError` (a
:class:`hpcrl.run.rundir.RunDirError`: exit 2 at the entry points).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

from hpcrl.run.rundir import RunDirError

__all__ = ["LEARNER", "MANIFEST", "MANIFEST_FORMAT", "PREFIX", "CheckpointError", "CorruptCheckpoint", "check_file",
           "checkpoint_root", "file_entry", "rank_file", "read_manifest", "step_of", "verify"]

PREFIX = "step_"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LEARNER = "learner.pt"
_STEP_DIR = re.compile(rf"^{PREFIX}(\d+)$")
_CHUNK = 1 << 20  # 1 MiB reads: ~3 GB/s here (16 MiB buffers were slower)


class CheckpointError(RunDirError):
    """No checkpoint can be resumed as asked; the message names the paths and what is wrong."""


class CorruptCheckpoint(CheckpointError):
    """One checkpoint directory is unusable (``path``, ``reason``)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def rank_file(rank: int) -> str:
    return f"rank{rank}.h5"


def file_entry(path: Path) -> dict[str, Any]:
    """Size and CRC-32 of a file (read back in chunks: just written, it is in the page cache)."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, structure checked; :class:`CorruptCheckpoint` otherwise."""
    file = path / MANIFEST
    try:
        text = file.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        legacy = " (a checkpoint from before manifests)" if (path / "meta.json").exists() else ""
        raise CorruptCheckpoint(path, f"no {MANIFEST}{legacy}") from None
    except OSError as err:
        raise CorruptCheckpoint(path, f"{MANIFEST} unreadable: {err}") from None
    try:
        manifest = json.loads(text)
    except ValueError as err:
        what = "empty" if not text.strip() else f"not valid JSON ({err})"
        raise CorruptCheckpoint(path, f"{MANIFEST} is {what}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(path, f"{MANIFEST} is not a JSON object")
    missing = [k for k in ("format", "step", "world_size", "files") if k not in manifest]
    if missing:
        raise CorruptCheckpoint(path, f"{MANIFEST} is incomplete: no {', '.join(missing)}")
    if manifest["format"] != MANIFEST_FORMAT:
        raise CorruptCheckpoint(path, f"{MANIFEST} format {manifest['format']!r}, expected {MANIFEST_FORMAT}")
    world, files = manifest["world_size"], manifest["files"]
    if not isinstance(world, int) or world < 1 or not isinstance(files, dict):
        raise CorruptCheckpoint(path, f"{MANIFEST} is malformed (world_size {world!r})")
    expected = [LEARNER] + [rank_file(r) for r in range(world)]
    absent = [n for n in expected if not isinstance(files.get(n), dict)
              or not isinstance(files[n].get("size"), int) or not isinstance(files[n].get("crc32"), str)]
    if absent:
        raise CorruptCheckpoint(path, f"{MANIFEST} is incomplete: no valid entry for {', '.join(absent)}")
    if manifest["step"] != step_of(path):
        raise CorruptCheckpoint(path, f"{MANIFEST} says step {manifest['step']!r}, the directory name another")
    return manifest


def check_file(path: Path, name: str, manifest: dict[str, Any], checksum: bool = True) -> None:
    want = manifest["files"][name]
    try:
        size = (path / name).stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(path, f"{name} is missing") from None
    if size != want["size"]:
        raise CorruptCheckpoint(path, f"{name} has {size} bytes, the manifest says {want['size']} (truncated?)")
    if checksum:
        got = file_entry(path / name)
        if got["crc32"] != want["crc32"] or got["size"] != want["size"]:
            raise CorruptCheckpoint(path, f"{name}: checksum mismatch (crc32 {got['crc32']}, the manifest says "
                                          f"{want['crc32']}): damaged after it was written")


def verify(path: Path, names: list[str] | None = None, checksum: bool = True) -> dict[str, Any]:
    """Check ``names`` (default: every file of the manifest) of checkpoint ``path``; returns the manifest."""
    manifest = read_manifest(path)
    for name in names if names is not None else list(manifest["files"]):
        check_file(path, name, manifest, checksum)
    return manifest
