"""The batch script submitit writes for a request: its parameters, and the text itself (``--dry-run``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from submitit.slurm import slurm as submitit_slurm

from .errors import LaunchError
from .request import FLAGS, JobRequest

# sbatch reads an #SBATCH line like a shell word list: whitespace ends the value, quotes and backslashes are
# removed, '#' starts a comment. The folder goes into "#SBATCH --output=FOLDER/..." unquoted.
_SBATCH_SPECIAL = frozenset(" \t\"'\\#")


def folder_path(request: JobRequest) -> Path:
    # as submitit's Executor stores it: user-expanded and absolute
    return Path(request.folder).expanduser().absolute()


JOB_SECRET_LINE = ('export HPCRL_JOB_SECRET="${HPCRL_JOB_SECRET:-$(head -c 32 /dev/urandom | od -An -tx1 | '
                   "tr -d ' \\n')}\"")

# The task count of this start's allocation, for srun (which reads SLURM_NTASKS as --ntasks) and the ranks.
# sbatch stores SLURM_NTASKS in the job's environment at submission, so after `scontrol update` of a requeued
# job's NumNodes it is stale; SLURM_TASKS_PER_NODE ("2(x3),1") is set anew at every start. Also in
# slurm/fastsac.sbatch (tests/test_slurm.py checks the two agree).
ALLOC_TASKS_LINE = ('ntasks=0; tpn=${SLURM_TASKS_PER_NODE:-}; for g in ${tpn//,/ }; do x=${g#*(x}; [ "$x" = "$g" ] '
                    '&& x=1; ntasks=$(( ntasks + ${g%%(*} * ${x%)} )); done; '
                    'if [ "$ntasks" -gt 0 ]; then export SLURM_NTASKS=$ntasks SLURM_NPROCS=$ntasks; fi')


def slurm_parameters(request: JobRequest) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` arguments: one srun task per rank (per GPU when GPUs are asked).

    Every value lands in a ``#SBATCH`` line (the folder in ``--output``/``--error``, also shell-quoted on the
    srun line): :meth:`JobRequest.check_values` runs first, so a newline, a control character or a character
    sbatch treats specially cannot end a line or start a command, whether or not the caller ran ``check()``.
    The trainer arguments never enter the script: they travel pickled in the submitit task and reach the
    trainer as an argv list, without a shell."""
    request.check_values()
    folder = str(folder_path(request))
    special = sorted(set(folder) & _SBATCH_SPECIAL) + sorted({ch for ch in folder if ch.isspace()} - _SBATCH_SPECIAL)
    if special:
        raise LaunchError(f"folder={request.folder!r} ({FLAGS['folder']}): its absolute path {folder!r} holds "
                          f"{''.join(special)!r}, which '#SBATCH --output=' cannot carry (sbatch splits the line on "
                          "whitespace, strips quotes and backslashes, starts a comment at '#'); choose a --folder "
                          "path without them")
    params: dict[str, Any] = {
        "job_name": request.job_name,
        "nodes": request.nodes,
        "ntasks_per_node": request.ntasks_per_node,
        "cpus_per_task": request.cpus_per_task,
        "time": request.time_min,
        "signal_delay_s": request.signal_delay_s,
        # scontrol requeue (submitit's checkpoint path) needs a requeueable job on clusters with JobRequeue=0
        "additional_parameters": {"requeue": True},
        # One secret per job attempt, made on the node (never in the submitit folder), in the tasks'
        # environment only: the ranks sign the store keys they write with it (docs/trust.md). Then the
        # task count of this start's allocation (a requeued job may have been resized, docs/elastic.md).
        "setup": [JOB_SECRET_LINE, ALLOC_TASKS_LINE],
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
