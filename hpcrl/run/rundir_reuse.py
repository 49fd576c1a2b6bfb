"""Whether a run may start fresh in a run directory, and ``--overwrite``. Torch-free: the entry points
ask before anything heavy is imported or any rank is spawned; under srun / torchrun every rank runs
the entry point, so every rank asks (:func:`check_start`), before its rendezvous.

A directory that holds a previous run (finished or interrupted: a committed checkpoint, a metrics
row, a best/final policy, an outcome record, an hf export, or a half-done ``--overwrite``) is refused
for a fresh start with one line: ``--resume`` continues it, ``--overwrite`` replaces it, or use
another ``--run-dir``. A directory with none of these (empty, created by hand, or left by a start
that failed before its first row) is free: nothing in it is worth keeping. ``--resume --resume-missing
fresh`` with no committed checkpoint is refused on a previous run too (starting fresh would delete
it; :func:`check_fresh_fallback`), except in a requeued Slurm job, which replaces what its own first
start wrote.

``--overwrite`` (:func:`remove_run`) first moves every file hpcrl writes into one trash directory
inside the run dir, then deletes that: a start killed midway leaves the trash, which still counts
as a previous run, so the next start is refused again instead of mixing old files with new ones.
Files hpcrl does not write are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from hpcrl.run.rundir import RunDirError, probe

__all__ = ["RUN_FILES", "check_fresh_fallback", "check_fresh_start", "check_resumable", "check_start", "committed_steps",
           "nothing_to_resume", "overwrite", "previous_run", "remove_run", "requeued"]

RUN_FILES = ("config.json", "metrics.jsonl", "outcome.json", "wandb_id", "checkpoints", "best", "final", "tb",
             "wandb", "hf")
"""Everything hpcrl writes into a run directory (besides its ``.lock`` and the ranks' ``logs/``)."""
LOGS = "logs"
"""The ranks' native-stderr logs: written from the first moment of a rank, so only ``--overwrite`` before
any rank starts removes them (a rank-0 clear at start-up would unlink the logs the ranks just opened)."""
TRASH = ".overwritten-"  # prefix of the directory an --overwrite empties into
_STEP_DIR = re.compile(r"^step_\d+$")  # a committed checkpoint (hpcrl.run.checkpoint.PREFIX)


def committed_steps(run_dir: str | os.PathLike) -> list[str]:
    """Names of the committed checkpoint directories of ``run_dir`` (unsorted; nothing verified)."""
    root = Path(run_dir) / "checkpoints"
    try:
        return [p.name for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    except OSError:
        return []


def _metrics_rows(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def previous_run(run_dir: str | os.PathLike) -> str | None:
    """What a previous run left in ``run_dir`` ("2 checkpoint(s), 41 metrics row(s), best/"), or None
    when nothing there is worth keeping."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = []
    if steps := committed_steps(run_dir):
        found.append(f"{len(steps)} checkpoint(s)")
    if rows := _metrics_rows(run_dir / "metrics.jsonl"):
        found.append(f"{rows} metrics row(s)")
    found += [f"{name}/" for name in ("best", "final", "hf") if (run_dir / name).exists()]
    if (run_dir / "outcome.json").exists():
        found.append("outcome.json")
    if any(p.name.startswith(TRASH) for p in run_dir.iterdir()):
        found.append("an unfinished --overwrite")
    return ", ".join(found) or None


def check_fresh_start(run_dir: str | os.PathLike, resume: bool, overwrite: bool) -> None:
    """:class:`~hpcrl.run.rundir.RunDirError` (one line, exit 2) when a live run on this host holds
    ``run_dir``'s lock, or when a fresh start (no ``--resume``, no ``--overwrite``) would replace a
    previous run's files."""
    probe(run_dir)
    if resume or overwrite:
        return
    if (what := previous_run(run_dir)) is not None:
        raise RunDirError(f"run dir {run_dir} holds a previous run ({what}); pass --resume to continue it, "
                          "--overwrite to replace it, or another --run-dir")


def nothing_to_resume(run_dir: str | os.PathLike) -> str:
    """"no checkpoint in DIR" (and whether only an uncommitted one is there), for the --resume messages."""
    root = Path(run_dir) / "checkpoints"
    torn = root.is_dir() and any(p.name.startswith(".tmp-step_") for p in root.iterdir())
    return f"no checkpoint in {root}" + (" (only an uncommitted one: the run was stopped while writing its first "
                                         "checkpoint)" if torn else "")


def check_resumable(run_dir: str | os.PathLike, resume: bool, resume_missing: str) -> None:
    """``--resume`` with no committed checkpoint and ``--resume-missing error``: the one-line refusal the
    ranks would give, before any of them starts (whether a checkpoint is usable, the ranks decide)."""
    if resume and resume_missing != "fresh" and not committed_steps(run_dir):
        raise RunDirError(f"--resume: {nothing_to_resume(run_dir)}; run without --resume to start fresh, or pass "
                          "--resume-missing fresh to start fresh whenever there is nothing to resume")


def remove_run(run_dir: str | os.PathLike, names: tuple[str, ...] = RUN_FILES) -> list[str]:
    """Delete every file hpcrl wrote in ``run_dir`` (:data:`RUN_FILES`, and the trash of an earlier
    unfinished call); returns the names removed. The caller holds the run-dir lock, or has checked
    that no run holds it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    trash = run_dir / f"{TRASH}{os.getpid()}"
    present = [name for name in names if os.path.lexists(run_dir / name)]
    if present:
        trash.mkdir(exist_ok=True)
        for name in present:  # renames: after the first, the trash marks the run dir as not yet empty
            os.replace(run_dir / name, trash / name)
    for p in run_dir.iterdir():
        if p.name.startswith(TRASH):
            shutil.rmtree(p)
    return present


def requeued() -> bool:
    """This process belongs to a Slurm job that was requeued (``SLURM_RESTART_COUNT`` > 0: preempted,
    node failure, or requeued after a requested stop): the run dir holds what this job's earlier start
    wrote, which its restart continues or, with nothing committed to continue, replaces."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False


def check_fresh_fallback(run_dir: str | os.PathLike, resume: bool, resume_missing: str, overwrite: bool) -> None:
    """``--resume --resume-missing fresh`` with no committed checkpoint starts fresh, which removes what is
    in ``run_dir`` (:func:`hpcrl.run.checkpoint.clear`): :class:`~hpcrl.run.rundir.RunDirError` (one line, exit 2)
    when that is a previous run (metrics rows, best/, ...), unless this is a requeued restart of the job
    that wrote it (:func:`requeued`: the batch scripts and the launcher pass these flags to every restart,
    and a job preempted before its first checkpoint restarts from scratch, replacing its own rows)."""
    if not resume or overwrite or resume_missing != "fresh" or committed_steps(run_dir) or requeued():
        return
    if (what := previous_run(run_dir)) is not None:
        raise RunDirError(f"--resume --resume-missing fresh: {nothing_to_resume(run_dir)}, but run dir {run_dir} "
                          f"holds a previous run ({what}) that starting fresh would delete; pass --overwrite to "
                          "replace it, or another --run-dir")


def check_start(run_dir: str | os.PathLike, resume: bool, resume_missing: str, overwrite: bool) -> None:
    """Everything an entry point checks about the run dir before it starts or spawns a rank:
    :func:`check_fresh_start`, :func:`check_resumable` and :func:`check_fresh_fallback`. Every process a
    launcher starts runs the entry point, so each asks before its rendezvous, when no rank can hold the
    lock yet."""
    check_fresh_start(run_dir, resume, overwrite)
    check_resumable(run_dir, resume, resume_missing)
    check_fresh_fallback(run_dir, resume, resume_missing, overwrite)


def overwrite(run_dir: str | os.PathLike) -> None:
    """``--overwrite`` in an entry point that launches the run's only process or spawns its ranks:
    remove the previous run's files (said on stderr) before any rank starts. Under a launcher that
    starts several ranks, rank 0 does it instead, holding the run-dir lock (:func:`hpcrl.run.checkpoint.clear`),
    so that no two processes delete at once."""
    probe(run_dir)  # again, right before deleting: a run may have started there since the config check
    if removed := remove_run(run_dir, (*RUN_FILES, LOGS)):
        print(f"hpcrl: --overwrite: removed the previous run in {run_dir} ({', '.join(removed)})",
              file=sys.stderr, flush=True)
