"""What to launch: one typed request, checked before anything touches the scheduler."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import hpcrl

from .errors import LaunchError  # re-exported: hpcrl.launch.request.LaunchError keeps working
from .roles import check_ppo_world

JOB_ID = "%j"  # placeholder in run_dir / folder, filled with the job id (Slurm's own notation)

# Flags the launcher sets on the trainer itself; passing them as trainer arguments would be ambiguous.
_OWNED_FLAGS = {"--run-dir": "run_dir", "--resume": "resume", "--nproc": "nodes / tasks_per_node"}


def trainer_algos() -> list[str]:
    """Every ``hpcrl.<algo>`` package with a ``__main__`` (``python -m hpcrl.<algo>``), except this one."""
    return sorted(m.name for m in pkgutil.iter_modules(hpcrl.__path__)
                  if m.ispkg and m.name != "launch" and _has_main(m.name))


def _has_main(algo: str) -> bool:
    # find_spec of the package (not of its __main__) imports nothing of the trainer
    spec = importlib.util.find_spec(f"hpcrl.{algo}")
    paths = spec.submodule_search_locations if spec is not None else None
    return bool(paths) and any((Path(p) / "__main__.py").is_file() for p in paths)


@dataclass(frozen=True)
class JobRequest:
    """One trainer job: ``nodes x tasks_per_node`` ranks, each running ``python -m hpcrl.<algo>``."""

    algo: str = "sac"
    trainer_args: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None
    """None: one task per GPU, or 1 without GPUs."""
    partition: str | None = None
    """None: the cluster's default partition."""
    time_min: int = 60
    cpus_per_task: int = 1
    run_dir: str = f"runs/{{algo}}-{JOB_ID}"
    """Trainer run directory; ``{algo}`` and ``%j`` (job id) are filled in, so a requeue finds it again."""
    resume: bool = False
    """Continue the run in ``run_dir`` (it must hold checkpoints)."""
    folder: str = f"logs/{JOB_ID}"
    """submitit's folder: batch script, pickles, one stdout/stderr log per task."""
    signal_delay_s: int = 180
    """USR2 this long before the time limit: the ranks finish a metrics row and checkpoint in that time."""

    @property
    def ntasks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1

    @property
    def module(self) -> str:
        return f"hpcrl.{self.algo}"

    @property
    def job_name(self) -> str:
        return f"hpcrl-{self.algo}"

    @property
    def run_dir_template(self) -> str:
        return self.run_dir.format(algo=self.algo)

    def check(self) -> None:
        """Errors that need no cluster: sizes, the entry point, trainer arguments, the run directory."""
        for name in ("nodes", "ntasks_per_node", "time_min", "cpus_per_task", "signal_delay_s"):
            if getattr(self, name) < 1:
                raise LaunchError(f"{name}={getattr(self, name)} must be >= 1")
        if self.gpus_per_node < 0:
            raise LaunchError(f"gpus_per_node={self.gpus_per_node} must be >= 0")
        if self.gpus_per_node and self.ntasks_per_node != self.gpus_per_node:
            raise LaunchError(f"tasks_per_node={self.tasks_per_node} but gpus_per_node={self.gpus_per_node}: "
                              "one task (rank) per GPU; leave tasks_per_node unset")
        if self.signal_delay_s >= self.time_min * 60:
            raise LaunchError(f"signal_delay_s={self.signal_delay_s} is not shorter than the time limit "
                              f"({self.time_min} min): the job would be signalled at its start")
        if not (self.algo.isidentifier() and _has_main(self.algo)) or self.algo == "launch":
            raise LaunchError(f"no trainer 'python -m hpcrl.{self.algo}'; choose one of {trainer_algos()}")
        for arg in self.trainer_args:
            flag = arg.split("=", 1)[0]
            if flag in _OWNED_FLAGS:
                raise LaunchError(f"trainer argument {flag} is set by the launcher; use {_OWNED_FLAGS[flag]} instead")
        if self.algo == "ppo":  # ranks [0, T) train, [T, T+M) make experience: T + M must be the task count
            check_ppo_world(self.trainer_args, self.nodes * self.ntasks_per_node)
        self._check_run_dir()

    def _check_run_dir(self) -> None:
        path = Path(self.run_dir_template)
        if self.resume:
            if JOB_ID in str(path):
                raise LaunchError(f"resume=True needs the run directory of an earlier job, not the template {path}")
            if not (path / "checkpoints").is_dir():
                raise LaunchError(f"nothing to resume: {path / 'checkpoints'} does not exist")
            return
        # the job creates the directory: the nearest existing ancestor must be a writable directory
        ancestor = path
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            raise LaunchError(f"run directory {path} cannot be created: {ancestor} is not a writable directory")
