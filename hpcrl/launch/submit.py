"""Submit a trainer job through submitit: Slurm when ``sbatch`` exists, the local executor otherwise."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

import submitit
from submitit.core.utils import FailedJobError

from .cluster import check_fits, query_partitions
from .errors import LaunchError
from .request import JOB_ID, JobRequest
from .sbatch import folder_path, render, slurm_parameters
from .task import TrainerResult, TrainerTask


@dataclass(frozen=True)
class Submission:
    request: JobRequest
    cluster: Literal["slurm", "local"]
    run_dir: str
    """Absolute, with the job id filled in (still the template in a dry run)."""
    sbatch: str | None
    """The batch script: the one submitted (Slurm), the one that would be (dry run); None for local jobs."""
    job: submitit.Job | None = None
    """None in a dry run."""

    @property
    def job_id(self) -> str | None:
        return self.job.job_id if self.job is not None else None

    def results(self) -> list[TrainerResult]:
        """Wait for the job; one result per rank of the run that finished (rank 0's carries the final metrics
        row). A job resized on requeue has as many as its last allocation's tasks, not its submission's.
        Raises when the job failed or ended without results (cancelled, or stopped without a requeue)."""
        assert self.job is not None, "a dry run submitted nothing"
        first = self.job.task(0).results()[0]
        if first.world_size == self.job.num_tasks:
            return self.job.results()
        # resized: the tasks of the last start (submitit's Job knows the submission's count only)
        folder = self.job.paths.folder
        return [first] + [type(self.job)(folder, self.job.job_id, tasks=(k,)).results()[0]
                          for k in range(1, first.world_size)]

    def summary(self) -> str:
        """Job id, run directory and log paths (what the CLI prints)."""
        assert self.job is not None, "a dry run submitted nothing; its batch script is .sbatch"
        r = self.request
        where = f"partition {r.partition or '(default)'}" if self.cluster == "slurm" else "this host"
        shape = f"{r.nodes} node(s) x {r.ntasks_per_node} task(s), {r.gpus_per_node} GPU(s) per node, {where}"
        out, err = self.job.paths.stdout, self.job.paths.stderr
        return (f"submitted job {self.job_id} ({self.cluster}: {shape})\n"
                f"  run dir: {self.run_dir}\n"
                f"  logs:    {out}\n           {err}\n"
                f"           (task 0; task t writes {self.job_id}_<t>_log.out/.err in {out.parent})")


def submit(algo: str = "sac", trainer_args: Sequence[str] = (), *, local: bool | None = None, dry_run: bool = False,
           **fields: Any) -> Submission:
    """Start ``python -m hpcrl.<algo> *trainer_args`` as ``nodes x tasks_per_node`` ranks (one per GPU).

    ``fields``: the other :class:`JobRequest` fields by name (``nodes``, ``gpus_per_node``, ``time_min``,
    ...). ``local``: None picks Slurm when ``sbatch`` is on PATH, else submitit's local executor (this
    host, ``tasks_per_node`` processes); True/False force one. ``run_dir`` and ``folder`` may hold ``%j``
    (the job id), ``run_dir`` also ``{algo}``. ``dry_run`` submits nothing and returns the Slurm batch
    script in ``Submission.sbatch``. Raises :class:`LaunchError` for a request that cannot run, before
    submitting it where possible.
    """
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(JobRequest)})
    if unknown:
        raise TypeError(f"submit() got unexpected keyword argument(s) {', '.join(unknown)}; see JobRequest")
    return submit_request(JobRequest(algo=algo, trainer_args=tuple(trainer_args), **fields), local=local,
                          dry_run=dry_run)


def submit_request(request: JobRequest, *, local: bool | None = None, dry_run: bool = False) -> Submission:
    """:func:`submit` of a whole :class:`JobRequest`."""
    request.check()
    slurm = _use_slurm(local)
    if slurm:
        check_fits(request, query_partitions())
    elif request.nodes > 1:
        raise LaunchError(f"nodes={request.nodes}: the local executor runs on this host only (nodes=1)")
    run_dir_template = os.path.abspath(request.run_dir_template)
    if dry_run:
        return Submission(request, "slurm" if slurm else "local", run_dir_template, render(request))

    executor = _executor(request, slurm)
    task = TrainerTask(request.module, request.trainer_args, run_dir_template, request.resume, request.overwrite)
    # Submitting from inside a job: its SLURM_* and rank variables must not leak into the new job
    # (sbatch reads some of them as options; the local executor's ranks would think they run under srun).
    with submitit.helpers.clean_env(), _job_secret(slurm):
        try:
            job = executor.submit(task)
        except FailedJobError as err:
            raise LaunchError(f"sbatch rejected the job: {err}") from None
    sbatch = job.paths.submission_file.read_text() if slurm else None
    return Submission(request, "slurm" if slurm else "local", run_dir_template.replace(JOB_ID, job.job_id),
                      sbatch, job)


@contextlib.contextmanager
def _job_secret(slurm: bool) -> Iterator[None]:
    """For the local executor: one secret for all of the job's tasks, inherited from this process while
    it submits (the batch script makes its own under Slurm, see ``sbatch.JOB_SECRET_LINE``)."""
    if slurm or os.environ.get("HPCRL_JOB_SECRET"):
        yield
        return
    os.environ["HPCRL_JOB_SECRET"] = secrets.token_hex(32)
    try:
        yield
    finally:
        del os.environ["HPCRL_JOB_SECRET"]


def _use_slurm(local: bool | None) -> bool:
    if local:
        return False
    has_slurm = shutil.which("sbatch") is not None
    if local is False and not has_slurm:
        raise LaunchError("local=False but sbatch is not on PATH: no Slurm here")
    return has_slurm


def _executor(request: JobRequest, slurm: bool) -> submitit.Executor:
    folder = folder_path(request)
    if slurm:
        executor: submitit.Executor = submitit.SlurmExecutor(folder)
        executor.update_parameters(**slurm_parameters(request))
    else:
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(timeout_min=request.time_min, tasks_per_node=request.ntasks_per_node,
                                   gpus_per_node=request.gpus_per_node, nodes=1,
                                   signal_delay_s=request.signal_delay_s)
    return executor
