"""How a run ended, as its own process says, for the batch scripts (``run_dir/outcome.json``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpcrl.core.rundir_files import write_text

__all__ = ["OUTCOME", "clear_outcome", "finished_by_this_job", "main", "record_outcome"]

# What the run's own process says about how it ended, for the batch scripts: srun reports the worst
# task's exit code, so a detached-PPO job whose expendable maker was SIGKILLed looks failed (137)
# although the trainers finished. Trainer 0 records "finished" as its last act; the script asks
# `python -m hpcrl.run.rundir finished RUN_DIR` before believing srun's code.
OUTCOME = "outcome.json"


def _job() -> dict[str, str | None]:
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID"), "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}


def clear_outcome(run_dir: str | os.PathLike) -> None:
    """At the start of a run (or of a resumed one): no outcome until this run says how it ended."""
    Path(run_dir, OUTCOME).unlink(missing_ok=True)


def record_outcome(run_dir: str | os.PathLike, status: str, **fields: Any) -> None:
    """Atomically write ``run_dir/outcome.json``: ``status`` (e.g. "finished"), this job's id and
    restart count, and ``fields`` (JSON-serialisable numbers of the final row)."""
    write_text(Path(run_dir, OUTCOME), json.dumps({"status": status, **_job(), "time": time.time(), **fields}))


def finished_by_this_job(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The outcome record when it says "finished" and was written by this Slurm job and restart (any
    job when not under Slurm), else None."""
    try:
        record = json.loads(Path(run_dir, OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "finished":
        return None
    job = _job()
    if job["slurm_job_id"] is not None and (record.get("slurm_job_id"), record.get("restart")) != (
            job["slurm_job_id"], job["restart"]):
        return None
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "finished":
        print("usage: python -m hpcrl.run.rundir finished RUN_DIR  (exit 0 iff this job's run finished)", file=sys.stderr)
        return 2
    record = finished_by_this_job(argv[1])
    if record is None:
        return 1
    print(", ".join(f"{k}={v}" for k, v in record.items() if k not in ("status", "time", "slurm_job_id", "restart")))
    return 0
