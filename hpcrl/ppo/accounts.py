"""The run's sample accounts across the jobs of one run dir: one closing row, at the end, for the whole run.

A job that ends (stopped by a signal, or finished) adds its accounts (:func:`hpcrl.ppo.rows.closing_row`)
to those it resumed with and stores the sums next to its last checkpoint, as ``accounts.json`` in
that checkpoint's directory: they are known only after the drain, which follows the checkpoint's commit
(the checkpoint comes first so that a stop's grace time goes to it). The file is outside the manifest
and optional. A resume from that checkpoint carries the sums on; a resume from a checkpoint without
one (the job that wrote it was killed, not stopped) cannot know what was produced before it, and the
closing row says from which update its accounts run (``accounts_since_update``; 0: the whole run).
Only a job that finishes logs the closing row; a stopped job logs none (its sums wait in the checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.core.diskfault import DiskFault, fault_line, is_disk_error
from hpcrl.core.rundir_files import write_text

__all__ = ["ACCOUNTS", "KEYS", "carried", "combine", "store"]

ACCOUNTS = "accounts.json"
# additive across jobs: the closing row's counts
KEYS = ("samples_produced", "samples_consumed", "dropped_shutdown", "dropped_stale", "lost_in_flight", "makers_lost")


def carried(checkpoint: Path | None, version: int) -> dict[str, float]:
    """The sums stored with the resumed ``checkpoint`` at update ``version`` (none when starting fresh);
    without them, zeros and ``accounts_since_update`` = ``version``."""
    if checkpoint is None:
        return {**dict.fromkeys(KEYS, 0.0), "accounts_since_update": 0}
    try:
        saved = json.loads((checkpoint / ACCOUNTS).read_text())
        return {**{k: float(saved[k]) for k in KEYS}, "accounts_since_update": int(saved["accounts_since_update"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {**dict.fromkeys(KEYS, 0.0), "accounts_since_update": version}


def combine(before: dict[str, float], job: dict[str, float]) -> dict[str, float]:
    """The run's accounts so far: ``before`` (:func:`carried`) plus this job's closing accounts."""
    return {**{k: before[k] + job[k] for k in KEYS}, "accounts_since_update": before["accounts_since_update"]}


def store(checkpoint: Path, accounts: dict[str, float]) -> None:
    """Keep the run's accounts with its last checkpoint (atomically; the run dir's file mode)."""
    try:
        write_text(checkpoint / ACCOUNTS, json.dumps(accounts))
    except OSError as err:
        if not is_disk_error(err):
            raise
        raise DiskFault(fault_line(checkpoint / ACCOUNTS, err)) from None
