"""The function submitit runs in every task: one trainer rank as ``python -m hpcrl.<algo>``.

Entry-point contract (hpcrl.sac today; any ``hpcrl.<algo>`` that keeps it can be launched):
``python -m hpcrl.<algo> ARGS --run-dir DIR [--resume | --overwrite]``, ranks from the launcher's variables,
exit 0 when done, :data:`hpcrl.core.conventions.EXIT_STOPPED` (75) after a requested stop wrote a
checkpoint (SIGUSR2/SIGTERM), anything else a failure (``EXIT_FAILED``, ``EXIT_BAD_CONFIG``, a
signal); rank 0 appends rows to ``DIR/metrics.jsonl``.

Requeue (submitit's checkpoint mechanism): on USR2 submitit calls :meth:`TrainerTask.checkpoint`
in task 0. It makes the trainer stop at its next agreed checkpoint, waits for it, and returns the
same task with ``--resume``; submitit stores that and requeues the job, whose rerun continues
from the checkpoint in the same run directory (``%j`` in it is the job id, which a requeue keeps).
A job Slurm requeues by itself (preemption, node failure: ``SLURM_RESTART_COUNT`` > 0) resumes too.
The rerun's rank count is its own allocation's (a pending requeued job may be resized with ``scontrol
update``; the batch script's setup recomputes ``SLURM_NTASKS``, and the trainer reshards its checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED, rendezvous_port

from .request import JOB_ID

# Exit codes after which resuming from the last checkpoint loses nothing: a requested stop, or the stop
# signal arriving before the trainer installed its handler (it was still starting up).
RESUMABLE = (EXIT_STOPPED, -signal.SIGUSR2)


class TrainerError(RuntimeError):
    """The trainer exited with a failure code; its output is in this task's log."""


@dataclass(frozen=True)
class TrainerResult:
    rank: int
    run_dir: str
    final_metrics: dict | None
    """The last metrics.jsonl row (rank 0 only; the rows are already reduced over all ranks)."""
    world_size: int = 1
    """The ranks of the run that finished (a requeued job may have been resized since submission)."""


class _Trainer:
    """The trainer subprocess. A thread waits for it, so that a signal handler can wait as well:
    ``Popen.wait`` holds a lock while blocked, and a handler interrupting it would deadlock on it."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(cmd, env=env)  # stdout/stderr: this task's submitit log
        self.returncode: int | None = None
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.returncode = self.process.wait()

    def wait(self) -> int:
        while self.returncode is None:
            time.sleep(0.2)
        return self.returncode

    def stop(self) -> int:
        """Ask for the agreed stop (Slurm signals the whole step, submitit's local executor only us)."""
        if self.returncode is None:
            self.process.send_signal(signal.SIGUSR2)
        return self.wait()


def rank_environment(job: submitit.JobEnvironment) -> dict[str, str]:
    env = dict(os.environ)
    if job.cluster == "slurm":
        return env  # srun set SLURM_PROCID/NTASKS/LOCALID/STEP_ID/JOB_NODELIST: what hpcrl.comm reads
    # submitit's local executor: N processes on this host, described to the trainer as torchrun would
    # (HPCRL_LAUNCHER=local: the run's config.json says "local", not "torchrun"); the job id is the pid
    # of submitit's controller process, the port the one the rule gives step 0 of a job of that id
    env.update(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port(int(job.job_id))), HPCRL_LAUNCHER="local")
    return env


@dataclass
class TrainerTask(Checkpointable):
    module: str
    """``python -m`` target, e.g. ``hpcrl.sac``."""
    trainer_args: tuple[str, ...]
    run_dir: str
    """Absolute; ``%j`` becomes the job id, which a requeued job keeps."""
    resume: bool = False
    overwrite: bool = False
    """Pass ``--overwrite`` on the first start (a requeue resumes instead: it must keep what this job wrote)."""

    _trainer = None  # the running _Trainer (not a field: never pickled into a resubmission)

    def __call__(self) -> TrainerResult:
        job = submitit.JobEnvironment()
        run_dir = self.run_dir.replace(JOB_ID, job.job_id)
        # a job requeued by Slurm itself (preemption, node failure) never passed through checkpoint()
        resume = self.resume or int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
        cmd = [sys.executable, "-m", self.module, *self.trainer_args, "--run-dir", run_dir]
        # a requeue before the first checkpoint committed finds nothing to resume: that run starts over
        start = ["--resume", "--resume-missing", "fresh"] if resume else ["--overwrite"] if self.overwrite else []
        self._trainer = _Trainer(cmd + start, rank_environment(job))
        code = self._trainer.wait()
        if code in RESUMABLE:
            # Stopped for a requeue: leave no result, the rerun writes it. Task 0's requeue happens in
            # submitit's USR2 handler (checkpoint below); without USR2 the job ends and result() raises.
            raise SystemExit(EXIT_STOPPED)
        if code != 0:
            raise TrainerError(f"python -m {self.module} {describe_exit(code)} on rank {job.global_rank}; "
                               "its output is in this task's log")
        return TrainerResult(job.global_rank, run_dir, _last_row(run_dir) if job.global_rank == 0 else None,
                             job.num_tasks)

    def checkpoint(self) -> DelayedSubmission:
        if self._trainer is not None:
            code = self._trainer.stop()
            # 0: it finished just before stopping; the resumed rerun repeats the work since the last
            # checkpoint and ends with the same numbers
            if code not in (0, *RESUMABLE):
                raise TrainerError(f"python -m {self.module} {describe_exit(code)} while stopping for a requeue")
        return DelayedSubmission(dataclasses.replace(self, resume=True))


def describe_exit(code: int) -> str:
    """A trainer's exit status in words (the CLIs' codes from :mod:`hpcrl.core.conventions`)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (job cancelled or past its time limit)" if -code == signal.SIGTERM else "")
    meaning = {EXIT_FAILED: " (a rank failed)", EXIT_BAD_CONFIG: " (bad configuration)"}
    return f"exited with {code}" + meaning.get(code, "")


def _last_row(run_dir: str) -> dict | None:
    path = Path(run_dir) / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return json.loads(lines[-1]) if lines else None
