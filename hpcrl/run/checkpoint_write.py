"""Writing a checkpoint (:func:`save`, re-exported by :mod:`hpcrl.run.checkpoint`): every rank its file,
rank 0 the learner, the metrics rows of the step, the manifest and the commit by a rename; a disk
fault on any rank stops every rank with one line, nothing half-written left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hpcrl.run.checkpoint_manifest import (LEARNER, MANIFEST, MANIFEST_FORMAT, PREFIX, file_entry, step_of, checkpoint_root,
                                       rank_file)
from hpcrl.run.checkpoint_rows import METRICS, ROWS, tail_rows
from hpcrl.core.diskfault import DiskFault, fault_line, owned_file, warn_low_space
from hpcrl.core.h5io import save_h5
from hpcrl.core.rundir_files import atomic_path
from hpcrl.run.rundir import file_mode, identity_hash, make_dir, normalize_identity, write_text

__all__ = ["FORMAT_VERSION", "fsync_dir", "save"]

FORMAT_VERSION = 1  # of the HDF5 rank files
TRASH = ".trash-"  # prefix of a checkpoint directory being deleted (never counts, swept by the next save)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

# -- writing ----------------------------------------------------------------------------------------
FAULT = ".fault-"  # prefix of a rank's one-line report that its part of a checkpoint could not be written


def save(run_dir: str | os.PathLike, step: int, rank: int, world_size: int, learner: dict[str, Any] | None,
         rank_state: dict[str, Any], barrier: Callable[[str], None], keep: int = 2, *,
         identity: Mapping[str, Any] | None = None, extra: Callable[[Path], list[str]] | None = None,
         rows: str | None = None) -> Path:
    """Collective: every rank calls it with its own ``rank_state``; rank 0 also passes ``learner``.

    ``identity``: what must not change when this run resumes (recorded in the manifest; pass the
    same on every rank). After the commit rank 0 keeps the ``keep`` newest checkpoints up to
    ``step`` and deletes any of a later step (an abandoned future: this run resumed from before it).

    A write that fails (a full disk, an I/O error) stops every rank with the same :class:`DiskFault`
    (each failed path and the free space), the partial checkpoint removed and the committed ones
    untouched: a failed rank posts its line instead of its checksum, rank 0 posts the verdict instead
    of committing, and every rank reads it after the commit barrier. Barriers bound every wait.

    ``extra(tmp)`` (every rank, before its own file; may be a collective of the ranks, e.g. a
    ``torch.distributed.checkpoint`` save): writes more files under ``tmp`` and returns their names
    relative to it, which go into the manifest with their checksums like the rank files. ``rows``:
    the metrics rows to store (default: the tail of ``metrics.jsonl`` now; a writer running behind
    the training loop passes the rows of its own step).
    """
    root = checkpoint_root(run_dir)
    name = f"{PREFIX}{step:012d}"
    tmp, final = root / f".tmp-{name}", root / name
    fault = _attempt(root, lambda: _prepare(root, tmp)) if rank == 0 else ""
    barrier("ckpt-begin")
    fault = fault or _attempt(tmp, lambda: _write_mine(run_dir, tmp, rank, learner, rank_state, extra, rows))
    if fault and rank != 0:
        _post(root / f"{FAULT}{name}-{rank}", fault)
    barrier("ckpt-written")
    if rank == 0:
        verdict = _commit_or_verdict(root, tmp, final, step, world_size, identity, keep, fault)
    barrier("ckpt-committed")
    if rank != 0:
        verdict = _read_post(root / f"{FAULT}{name}") or (f"checkpoint of step {step} not written: {fault}"
                                                          if fault else "")
    if verdict:
        barrier("ckpt-aborted")  # every rank has read the verdict: it and the partial checkpoint can go
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            for p in [root / f"{FAULT}{name}", *(root / f"{FAULT}{name}-{r}" for r in range(1, world_size))]:
                p.unlink(missing_ok=True)
        raise DiskFault(verdict)
    return final


def _attempt(where: Path, write: Callable[[], None]) -> str:
    """"" when ``write`` succeeds, else the one line of the failure (any OSError: the disk, not a bug)."""
    try:
        write()
    except DiskFault as err:
        return str(err)
    except OSError as err:
        return fault_line(Path(err.filename) if err.filename else where, err)
    return ""


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, file_mode())
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _post(path: Path, line: str) -> None:
    with contextlib.suppress(OSError):  # the disk may refuse even this: rank 0 then misses this rank's sum
        _write_private(path, line)


def _read_post(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _commit_or_verdict(root: Path, tmp: Path, final: Path, step: int, world_size: int,
                       identity: Mapping[str, Any] | None, keep: int, fault: str) -> str:
    """Rank 0: commit when every rank wrote its part, else post (and return) the line saying who failed."""
    name = final.name
    faults = {0: fault} if fault else {}
    files: dict[str, Any] = {}
    for r in range(world_size):
        side = tmp / f".{rank_file(r)}.sum"
        try:
            files.update(json.loads(side.read_text()))
        except (OSError, ValueError):  # missing, or cut short by the disk
            if r not in faults:
                faults[r] = _read_post(root / f"{FAULT}{name}-{r}") or f"{side}: rank {r} wrote no checksum"
    if not faults:
        failed = _attempt(tmp, lambda: _commit(root, tmp, final, step, world_size, identity, files))
        if not failed:
            with contextlib.suppress(OSError):  # committed: what is left is tidying, it must not undo that
                _prune(root, step, keep)
                size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
                warn_low_space(root, size, "the next checkpoint (as large as this one)")
            return ""
        faults[0] = failed
    what = "; ".join(f"rank {r}: {line}" for r, line in sorted(faults.items()))
    verdict = f"checkpoint of step {step} not written, the committed ones are untouched: {what}"
    _post(root / f"{FAULT}{name}", verdict)
    return verdict


def _prepare(root: Path, tmp: Path) -> None:
    make_dir(root)
    for p in root.iterdir():  # reports of a failed write, left by a run killed before it removed them
        if p.name.startswith(FAULT):
            p.unlink(missing_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # leftover of a job killed while writing this very step
    make_dir(tmp)


def _write_mine(run_dir: str | os.PathLike, tmp: Path, rank: int, learner: dict[str, Any] | None,
                rank_state: dict[str, Any], extra: Callable[[Path], list[str]] | None = None,
                rows: str | None = None) -> None:
    """This rank's file and its size and checksum (and those of its ``extra`` files); rank 0 also the
    learner and the latest metrics rows."""
    names = extra(tmp) if extra is not None else []  # first: a collective every rank must reach
    mine = rank_file(rank)
    save_h5(tmp / mine, rank_state, FORMAT_VERSION)
    sums = {mine: file_entry(tmp / mine), **{name: file_entry(tmp / name) for name in names}}
    _write_private(tmp / f".{mine}.sum", json.dumps(sums))
    if rank == 0:
        assert learner is not None
        with owned_file(tmp / LEARNER) as f:
            torch.save(learner, f)
        rows = tail_rows(Path(run_dir) / METRICS) if rows is None else rows
        if rows:
            write_text(tmp / ROWS, rows)


def _commit(root: Path, tmp: Path, final: Path, step: int, world_size: int, identity: Mapping[str, Any] | None,
            sums: dict[str, Any]) -> None:
    """Rank 0: the manifest (last: its presence means every file above is complete), then the rename."""
    files = {LEARNER: file_entry(tmp / LEARNER), **sums}
    if (tmp / ROWS).exists():
        files[ROWS] = file_entry(tmp / ROWS)
    for r in range(world_size):
        (tmp / f".{rank_file(r)}.sum").unlink()
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size,
                "identity": None if identity is None else normalize_identity(identity),
                "identity_hash": None if identity is None else identity_hash(identity),
                "created": time.time(), "host": socket.gethostname(), "checksum": "crc32", "files": files}
    with atomic_path(tmp / MANIFEST) as path:
        path.write_text(json.dumps(manifest, indent=1))
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory so that a kill at any moment leaves either all of it or nothing
    that counts: renamed out of the ``step_*`` namespace first (atomic), then removed. An rmtree in
    place, killed half way, would leave a committed-looking directory without its manifest."""
    trash = path.with_name(f"{TRASH}{path.name}")
    try:
        path.rename(trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: Path, step: int, keep: int) -> None:
    for p in root.iterdir():  # left by a run killed while discarding
        if p.name.startswith(TRASH):
            shutil.rmtree(p, ignore_errors=True)
    dirs = sorted((p for p in root.iterdir() if step_of(p) >= 0), key=step_of)
    for p in dirs:
        if step_of(p) > step:
            _discard(p)
    older = [p for p in dirs if step_of(p) <= step]
    for p in older[:-keep] if keep > 0 else []:
        _discard(p)
