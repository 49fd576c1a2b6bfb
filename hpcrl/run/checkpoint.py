"""Run-directory checkpoints: one directory per checkpoint, verified by a manifest, committed by a rename.

Layout: ``run_dir/checkpoints/step_<N>/`` holds ``learner.pt`` (global rank 0: networks,
optimisers, normaliser, counters, RNG), ``rank<r>.h5`` (every rank: replay shard, env state, RNG)
and ``manifest.json``: step, world size, the run's identity (:mod:`hpcrl.run.rundir`) and every file's
size and CRC-32. Files are first written to ``.tmp-step_<N>/`` and fsynced; each rank checksums its
own file; once every rank is done rank 0 writes the manifest last (fsynced), fsyncs the directory
and renames it into place, so a job killed mid-write never shadows the last good checkpoint.

Reading verifies: :func:`load` checks this rank's files against the manifest (size, checksum) before
unpickling; :func:`restore` (collective) takes the newest checkpoint every rank can load, reports
each unusable newer one (path and what is wrong) on stderr and falls back to the previous one;
:func:`latest` returns the newest fully verified checkpoint directory. A ``step_*`` directory
without a manifest (written before manifests existed, or damaged) is unusable. Errors that must stop
a resume (no usable checkpoint, another run's checkpoint, another world size) are
:class:`CheckpointError`, a :class:`hpcrl.run.rundir.RunDirError`: exit 2 at the entry points.

The manifest's names and checks live in :mod:`hpcrl.run.checkpoint_manifest`, the writing in
:mod:`hpcrl.run.checkpoint_write` (both re-exported here). A write that fails on the disk (full, I/O
error) on any rank stops every rank with the same :class:`~hpcrl.core.diskfault.DiskFault` line (each
failed path and the free space), the partial checkpoint removed, the committed ones untouched.
Rank 0 also stores the metrics rows of the step (``rows.jsonl``), which a resume restores when the
metrics file lost them (:mod:`hpcrl.run.checkpoint_rows`).

CRC-32 (zlib) runs at about 3 GB/s on one core here, i.e. a few percent of the time the write itself
takes; it detects damage (truncation, torn or foreign bytes), not tampering.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from hpcrl.run.checkpoint_manifest import (LEARNER, MANIFEST, MANIFEST_FORMAT, PREFIX, CheckpointError, CorruptCheckpoint,
                                       check_file, file_entry, step_of, checkpoint_root, rank_file, read_manifest,
                                       verify)
from hpcrl.run.checkpoint_write import FORMAT_VERSION, save
from hpcrl.core.diskfault import DiskFault
from hpcrl.core.h5io import load_h5, save_h5  # save_h5 re-exported: where tests and writers look for it
from hpcrl.run.rundir import RunDirError, identity_difference
from hpcrl.run.rundir_reuse import nothing_to_resume, remove_run

__all__ = ["CheckpointError", "CorruptCheckpoint", "DiskFault", "Restored", "checkpoint_root", "clear", "committed", "fresh_or_refuse",
           "latest", "load", "nothing_to_resume", "source_ranks", "preflight", "read_manifest", "restore", "save", "store_agree",
           "verify"]

# agree(reason) -> {rank: reason} of every rank whose reason is non-empty (the same dict on every rank)
Agree = Callable[[str], dict[int, str]]


def clear(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the previous run's files from ``run_dir`` (every checkpoint, committed or not, and
    everything else hpcrl wrote: :func:`hpcrl.run.rundir_reuse.remove_run`); returns the committed
    checkpoints removed. For a fresh start, on rank 0 holding the run-dir lock: the entry points
    refuse a run dir holding a previous run unless ``--overwrite`` (already done then) or
    ``--resume --resume-missing fresh`` found nothing to resume, so this is normally a no-op."""
    gone = committed(run_dir)
    remove_run(run_dir)
    return gone


# -- reading ----------------------------------------------------------------------------------------
def committed(run_dir: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories, newest first (nothing verified; ``.tmp-*`` never counts)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) >= 0 and p.is_dir()), key=step_of, reverse=True)


def _report(message: str) -> None:
    print(f"hpcrl: {message}", file=sys.stderr, flush=True)


def latest(run_dir: str | os.PathLike, *, report: bool = True) -> Path | None:
    """Newest committed checkpoint whose every file matches its manifest, or None. Each newer
    unusable one is reported on stderr (``report``). Reads every file: in a multi-rank job prefer
    :func:`restore`, where each rank checks only its own."""
    for path in committed(run_dir):
        try:
            verify(path)
        except CorruptCheckpoint as err:
            if report:
                _report(f"skipping unusable checkpoint {err}")
            continue
        return path
    return None


def _check_world(path: Path, manifest: dict[str, Any], world_size: int, reshard: bool = False) -> None:
    """Another world size is refused unless the caller reshards (its rank state is per env: FastSAC)."""
    if manifest["world_size"] != world_size and not reshard:
        raise CheckpointError(f"{path} was written by {manifest['world_size']} ranks but this job has {world_size}; "
                              "resume with the same number of ranks (replay shards are per rank)")


def source_ranks(old_world: int, new_world: int, rank: int) -> list[int]:
    """The ranks of a checkpoint written by ``old_world`` ranks whose files rank ``rank`` of ``new_world``
    reads when it reshards: those whose contiguous share of the envs overlaps its own."""
    return [r for r in range(old_world)
            if r * new_world < (rank + 1) * old_world and rank * old_world < (r + 1) * new_world]


# upgrade(saved identity) -> the identity as this version of the program writes it (fields since dropped
# removed, fields since added filled with the values that reproduce the old behaviour)
Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


def _check_identity(path: Path, manifest: dict[str, Any], identity: Mapping[str, Any], reshard: bool = False,
                    upgrade: Upgrade | None = None) -> None:
    saved = manifest.get("identity")
    if reshard and isinstance(saved, dict) and "world_size" not in identity:
        saved = {k: v for k, v in saved.items() if k != "world_size"}  # written before resharding existed
    if upgrade is not None and isinstance(saved, dict):
        saved = upgrade(saved)
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume: {path} records no run identity, so it cannot be matched to this run; "
                              "use another --run-dir (or pass --overwrite instead of --resume to start over there)")
    diff = identity_difference(saved, identity)
    if diff:
        raise CheckpointError(f"--resume: {path} belongs to another run: {diff}; resume with the settings it was "
                              "written with, or use another --run-dir")


def _load_files(path: Path, manifest: dict[str, Any], rank: int, device: torch.device
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    learner, ranks = _load_ranks(path, manifest, [rank], device)
    return learner, ranks[rank]


def _load_ranks(path: Path, manifest: dict[str, Any], ranks: list[int], device: torch.device
                ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    for name in (LEARNER, *map(rank_file, ranks)):
        check_file(path, name, manifest)
    try:
        learner = torch.load(path / LEARNER, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001  (any unpickling failure means the same: unusable)
        raise CorruptCheckpoint(path, f"{LEARNER} cannot be loaded: {type(err).__name__}: {err}") from None
    states = {}
    for r in ranks:
        try:
            states[r] = load_h5(path / rank_file(r), FORMAT_VERSION)
        except Exception as err:  # noqa: BLE001
            raise CorruptCheckpoint(path, f"{rank_file(r)} cannot be loaded: {type(err).__name__}: {err}") from None
    return learner, states


def load(path: Path, rank: int, world_size: int, device: torch.device, *,
         identity: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(learner state, this rank's state) of checkpoint ``path``, after checking its manifest, the
    world size, ``identity`` (when given) and this rank's files (size, checksum):
    :class:`CorruptCheckpoint` / :class:`CheckpointError` otherwise."""
    manifest = read_manifest(path)
    _check_world(path, manifest, world_size)
    if identity is not None:
        _check_identity(path, manifest, identity)
    return _load_files(path, manifest, rank, device)


def preflight(run_dir: str | os.PathLike, world_size: int, *, identity: Mapping[str, Any] | None = None,
              reshard: bool = False, upgrade: Upgrade | None = None) -> Path | None:
    """What every rank of a job can check before any of them loads (manifests only, the same verdict
    on every rank): the newest checkpoint with a readable manifest, its world size and ``identity``
    checked; None when there is no committed checkpoint. Raises :class:`CheckpointError` on another
    world size or run, or when no checkpoint has a readable manifest. Silent: :func:`restore` reports."""
    problems = []
    for path in committed(run_dir):
        try:
            manifest = read_manifest(path)
        except CorruptCheckpoint as err:
            problems.append(str(err))
            continue
        _check_world(path, manifest, world_size, reshard)
        if identity is not None:
            _check_identity(path, manifest, identity, reshard, upgrade)
        return path
    if problems:
        raise CheckpointError(f"--resume: no usable checkpoint in {checkpoint_root(run_dir)}: " + " | ".join(problems)
                              + "; pass --overwrite instead of --resume to start over there (this deletes them), or use another "
                              "--run-dir")
    return None


def fresh_or_refuse(run_dir: str | os.PathLike, resume_missing: str, announce: bool, prog: str) -> None:
    """``--resume`` found no usable checkpoint: with ``--resume-missing fresh`` the run starts fresh (the
    ``announce`` rank says so), else :class:`RunDirError` saying what is there and what to pass."""
    what = nothing_to_resume(run_dir)
    if resume_missing != "fresh":
        raise RunDirError(f"--resume: {what}; run without --resume to start fresh, or pass --resume-missing fresh "
                          "to start fresh whenever there is nothing to resume")
    if announce:
        print(f"{prog}: --resume: {what}; starting fresh (--resume-missing fresh)", flush=True)


@dataclass
class Restored:
    path: Path
    step: int
    learner: dict[str, Any]
    rank_state: dict[str, Any]  # this rank's file; {} when resharded (see rank_states)
    skipped: list[str]  # "path: reason" of each newer checkpoint that was unusable
    world_size: int = 0  # the ranks that wrote it; another than this job's only with reshard=True
    rank_states: dict[int, dict[str, Any]] | None = None  # resharded: the old ranks' files this rank reads


def restore(run_dir: str | os.PathLike, rank: int, world_size: int, device: torch.device, *,
            identity: Mapping[str, Any] | None = None, agree: Agree | None = None,
            report: bool = True, reshard: bool = False, upgrade: Upgrade | None = None,
            loader: Callable[[Path, dict[str, Any]], tuple[dict[str, Any], dict[int, dict[str, Any]]]] | None = None
            ) -> Restored | None:
    """The newest checkpoint of ``run_dir`` that every rank can load, loaded; None when there is none.

    Collective when ``agree`` is given (see :func:`store_agree`; needed with more than one rank, so
    that all fall back together): each rank verifies and loads only the learner file and its own
    rank file. An unusable checkpoint (manifest, size, checksum or unpickling) is reported on stderr
    by rank 0 and the previous one is tried. Raises :class:`CheckpointError` when checkpoints exist
    but none is usable (message: each path and what is wrong), and when the newest readable one
    was written by another world size or, with ``identity``, by another run (no fallback then:
    the older ones belong to that run too).

    ``reshard``: a checkpoint of another world size is loaded too, as the files of the old ranks
    :func:`source_ranks` names (``Restored.rank_states``); the caller re-deals them. An identity
    without ``world_size`` then also matches an older checkpoint whose identity has it.

    ``upgrade``: applied to a checkpoint's recorded identity before it is compared (an older layout
    of the identity brought to this one). ``loader(path, manifest)``: verifies and loads what this
    rank needs instead of the default (the learner file and this rank's file, or the source ranks'
    files): returns (learner state, {old rank: state}); a :class:`CorruptCheckpoint` it raises makes
    every rank fall back to the previous checkpoint.
    """
    candidates = committed(run_dir)
    if not candidates:
        return None
    speak = report and (rank == 0 or agree is None)
    skipped: list[str] = []
    for path in candidates:
        try:
            manifest = read_manifest(path)  # every rank reads the same manifest: the same verdict everywhere
        except CorruptCheckpoint as err:
            skipped.append(str(err))
            if speak:
                _report(f"skipping unusable checkpoint {err}")
            continue
        _check_world(path, manifest, world_size, reshard)
        if identity is not None:
            _check_identity(path, manifest, identity, reshard, upgrade)
        learner, states, failed = _load_agreed(path, manifest, rank, world_size, device, agree, loader)
        if not failed:
            old, step = int(manifest["world_size"]), int(manifest["step"])
            if loader is not None:
                return Restored(path, step, learner, states.get(rank, {}), skipped, old, states)
            if old == world_size:
                return Restored(path, step, learner, states[rank], skipped, old)
            return Restored(path, step, learner, {}, skipped, old, states)
        what = "; ".join(f"rank {r}: {why}" if world_size > 1 else why for r, why in sorted(failed.items()))
        skipped.append(f"{path}: {what}")
        if speak:
            _report(f"skipping unusable checkpoint {path}: {what}")
    root = checkpoint_root(run_dir)
    raise CheckpointError(f"--resume: no usable checkpoint in {root}: " + " | ".join(skipped)
                          + "; pass --overwrite instead of --resume to start over there (this deletes them), or use another "
                          "--run-dir")


def _load_agreed(path: Path, manifest: dict[str, Any], rank: int, world_size: int, device: torch.device,
                 agree: Agree | None, loader: Callable | None) -> tuple[dict, dict, dict[int, str]]:
    """Load what this rank needs of one checkpoint; ``(learner, {old rank: state}, {rank: why it failed})``,
    the failures agreed across ranks when ``agree`` is given (every rank then falls back together)."""
    old = int(manifest["world_size"])
    ranks = [rank] if old == world_size else source_ranks(old, world_size, rank)
    try:
        learner, states = _load_ranks(path, manifest, ranks, device) if loader is None else loader(path, manifest)
        reason = ""
    except Exception as err:  # noqa: BLE001  (one rank must not leave the others waiting in agree)
        reason = err.reason if isinstance(err, CorruptCheckpoint) else f"{type(err).__name__}: {err}"
        learner, states = {}, {}
    return learner, states, (agree(reason) if agree is not None else ({rank: reason} if reason else {}))


_MAX_REASON_CHARS = 4096  # a reason is one error line; longer store values are cut before use


def store_agree(ctx: Any, ranks: list[int] | None = None, name: str = "ckpt-restore") -> Agree:
    """An ``agree`` for :func:`restore` over the rendezvous store of ``ctx`` (``ranks``: the ranks that
    call restore, default the world): every rank posts its reason, waits for the others (a barrier
    that names who is missing) and reads them all."""
    from hpcrl.comm import barrier

    members = list(range(ctx.world_size)) if ranks is None else sorted(set(ranks))
    if not members or not all(0 <= r < ctx.world_size for r in members) or ctx.rank not in members:
        raise ValueError(f"store_agree: ranks {members} must be ranks of the world (0..{ctx.world_size - 1}) and "
                         f"include this rank ({ctx.rank})")
    counter = itertools.count()

    def agree(reason: str) -> dict[int, str]:
        if not getattr(ctx, "is_distributed", False) or ctx.store is None or len(members) < 2:
            return {ctx.rank: reason} if reason else {}
        gen = next(counter)
        # Through the job's SignedStore: a reason written by a process without the job secret (an
        # impostor "rank") fails the barrier or this read, naming its key, instead of steering the restore.
        ctx.store.set(f"{name}/{gen}/{ctx.rank}", reason[:_MAX_REASON_CHARS])
        barrier(ctx, name, ranks=members)
        keys = [f"{name}/{gen}/{r}" for r in members]
        got = {r: bytes(v[: _MAX_REASON_CHARS * 4]).decode(errors="replace")[:_MAX_REASON_CHARS]
               for r, v in zip(members, ctx.store.multi_get(keys))}
        return {r: why for r, why in got.items() if why}

    return agree
