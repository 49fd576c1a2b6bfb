"""Launch trainers on Slurm (or this host) through submitit: ``python -m hpcrl.launch`` / :func:`submit`.

Trainers are started by entry point (``python -m hpcrl.<algo>``, one process per task), never by
importing them; see :mod:`hpcrl.launch.task` for the contract an entry point keeps. The batch
script alternative without submitit is ``slurm/fastsac.sbatch``.
"""

from .cluster import Partition, check_fits, query_partitions
from .errors import LaunchError
from .request import JobRequest, trainer_algos
from .sbatch import render
from .submit import Submission, submit
from .task import TrainerError, TrainerResult, TrainerTask

__all__ = ["JobRequest", "LaunchError", "Partition", "Submission", "TrainerError", "TrainerResult", "TrainerTask",
           "check_fits", "query_partitions", "render", "submit", "trainer_algos"]
