"""The batch script submitit writes for a request: its parameters, and the text itself (``--dry-run``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from submitit.slurm import slurm as submitit_slurm

from .request import JobRequest


def folder_path(request: JobRequest) -> Path:
    # as submitit's Executor stores it: user-expanded and absolute
    return Path(request.folder).expanduser().absolute()


def slurm_parameters(request: JobRequest) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` arguments: one srun task per rank (per GPU when GPUs are asked)."""
    params: dict[str, Any] = {
        "job_name": request.job_name,
        "nodes": request.nodes,
        "ntasks_per_node": request.ntasks_per_node,
        "cpus_per_task": request.cpus_per_task,
        "time": request.time_min,
        "signal_delay_s": request.signal_delay_s,
        # scontrol requeue (submitit's checkpoint path) needs a requeueable job on clusters with JobRequeue=0
        "additional_parameters": {"requeue": True},
    }
    if request.gpus_per_node:
        params["gpus_per_node"] = request.gpus_per_node
    if request.partition:
        params["partition"] = request.partition
    return params


def render(request: JobRequest, python: str = sys.executable) -> str:
    """The sbatch text SlurmExecutor submits for ``request`` (submitit has no public dry run; this is the
    function and the command string ``SlurmExecutor._submit_command`` uses, so the text is identical)."""
    folder = folder_path(request)
    command = " ".join([shlex.quote(python), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **slurm_parameters(request))
