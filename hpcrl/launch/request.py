"""What to launch: one typed request, checked before anything touches the scheduler."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import unicodedata
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, get_type_hints

import tyro

import hpcrl

from hpcrl.run.rundir import RunDirError
from hpcrl.run.rundir_reuse import check_fresh_start

from .errors import LaunchError  # re-exported: hpcrl.launch.request.LaunchError keeps working
from .roles import check_ppo_world

JOB_ID = "%j"  # placeholder in run_dir / folder, filled with the job id (Slurm's own notation)

# Flags the launcher sets on the trainer itself; passing them as trainer arguments would be ambiguous.
_OWNED_FLAGS = {"--run-dir": "run_dir", "--resume": "resume", "--overwrite": "overwrite",
                "--nproc": "nodes / tasks_per_node"}

# Integer fields: (lowest valid value, what it counts); tasks_per_node may also be None.
_COUNTS = {"nodes": (1, "nodes to allocate"), "gpus_per_node": (0, "GPUs per node; 0 = CPU ranks"),
           "tasks_per_node": (1, "ranks per node; unset = one per GPU"), "time_min": (1, "minutes"),
           "cpus_per_task": (1, "CPUs per rank"), "signal_delay_s": (1, "seconds before the time limit")}

# Slurm partition names, or a comma-separated list of them.
_PARTITION = re.compile(r"[A-Za-z0-9_.\-]+(?:,[A-Za-z0-9_.\-]+)*")


def _control(ch: str) -> bool:
    """Control, format, surrogate, private-use or unassigned characters, line and paragraph separators
    (newline, carriage return, NUL, ESC, U+2028, ...): nothing a job field or argument ever needs."""
    return unicodedata.category(ch).startswith(("C", "Zl", "Zp"))


def _where(value: str) -> str:
    bad = next(i for i, ch in enumerate(value) if _control(ch))
    return f"{value[bad]!r} at position {bad}"


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
    """One trainer job: ``nodes x tasks_per_node`` ranks, each running ``python -m hpcrl.<algo>``. Every
    field is a flag of ``python -m hpcrl.launch`` (:data:`FLAGS`) and a keyword of :func:`~hpcrl.launch.submit`."""

    algo: Annotated[str, tyro.conf.Suppress] = "sac"
    """The trainer: ``python -m hpcrl.<algo>`` (the launcher's positional ALGO)."""
    trainer_args: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """The trainer's arguments (on the command line: everything after ``--``)."""
    nodes: int = 1
    """Nodes to allocate (>= 1)."""
    gpus_per_node: int = 0
    """One task (rank) per GPU; 0 = CPU ranks."""
    tasks_per_node: int | None = None
    """Ranks per node; None (unset): one task per GPU, or 1 without GPUs."""
    partition: str | None = None
    """None: the cluster's default partition."""
    time_min: Annotated[int, tyro.conf.arg(name="time")] = 60
    """Time limit in minutes."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    run_dir: str = f"runs/{{algo}}-{JOB_ID}"
    """Trainer run directory; ``{algo}`` and ``%j`` (job id) are filled in, so a requeue finds it again."""
    resume: bool = False
    """Continue the run in ``run_dir`` (it must hold checkpoints)."""
    overwrite: bool = False
    """Replace the previous run in ``run_dir`` (the trainer's --overwrite, on the job's first start only: a
    requeued job resumes what it wrote)."""
    folder: str = f"logs/{JOB_ID}"
    """submitit's folder: batch script, pickles, one stdout/stderr log per task."""
    signal_delay_s: Annotated[int, tyro.conf.arg(name="signal-delay")] = 180
    """USR2 this long before the time limit (seconds): the ranks finish a metrics row and checkpoint in that
    time, and the job requeues."""

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

    def check_values(self) -> None:
        """Each field on its own: types, ranges, and text that cannot break out of the batch script (no
        newline or other control character anywhere; no shell-special character in the #SBATCH values).
        :func:`hpcrl.launch.sbatch.slurm_parameters` runs it too, so no script is rendered from a bad request."""
        for f in fields(self):  # every text field, present and future: one line, no control characters
            value = getattr(self, f.name)
            texts = value if isinstance(value, tuple) else (value,)
            for text in texts:
                if isinstance(text, str) and any(map(_control, text)):
                    what = f"trainer argument {text!r}" if f.name == "trainer_args" else f"{f.name}={text!r}"
                    raise LaunchError(f"{what} ({FLAGS[f.name]}) holds the control character {_where(text)}: "
                                      "newlines and other control characters would end a line of the batch "
                                      "script or of the trainer's command; remove them")
        if not isinstance(self.algo, str) or not (self.algo.isascii() and self.algo.isidentifier()):
            raise LaunchError(f"algo={self.algo!r}: no trainer 'python -m hpcrl.<algo>' has that name; choose one of "
                              f"{trainer_algos()}")
        if not isinstance(self.trainer_args, tuple) or not all(isinstance(a, str) for a in self.trainer_args):
            raise LaunchError(f"trainer_args={self.trainer_args!r} ({FLAGS['trainer_args']}): must be a tuple of "
                              "strings")
        for name, (low, what) in _COUNTS.items():
            value = getattr(self, name)
            if value is None and name == "tasks_per_node":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise LaunchError(f"{name}={value!r} ({FLAGS[name]}): must be an integer >= {low} ({what}); "
                                  f"pass {FLAGS[name]} {low} or more")
        for name in ("resume", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise LaunchError(f"{name}={getattr(self, name)!r} ({FLAGS[name]}): must be True or False")
        if self.resume and self.overwrite:
            raise LaunchError("resume=True and overwrite=True (--resume --overwrite): --resume continues the run in "
                              "--run-dir, --overwrite replaces it; pass one of them")
        partition = self.partition
        if partition is not None and not (isinstance(partition, str) and _PARTITION.fullmatch(partition)):
            raise LaunchError(f"partition={self.partition!r} ({FLAGS['partition']}): must be a Slurm partition name "
                              "(letters, digits, '_', '-', '.'; several joined by ','); `sinfo -s` lists them")
        for name in ("folder", "run_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise LaunchError(f"{name}={value!r} ({FLAGS[name]}): must be a non-empty path")
        try:
            self.run_dir.format(algo="")
        except (KeyError, IndexError, ValueError) as err:
            raise LaunchError(f"run_dir={self.run_dir!r} ({FLAGS['run_dir']}): {{algo}} is the only placeholder in "
                              f"braces ({type(err).__name__}: {err}); write {{{{ and }}}} for literal braces") from None

    def check(self) -> None:
        """Errors that need no cluster: values (:meth:`check_values`), the entry point, trainer arguments,
        the run directory."""
        self.check_values()
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
        if JOB_ID not in str(path):  # a named run dir: the trainer would refuse a previous run there (exit 2)
            try:
                check_fresh_start(path, self.resume, self.overwrite)
            except RunDirError as err:
                raise LaunchError(str(err)) from None
        # the job creates the directory: the nearest existing ancestor must be a writable directory
        ancestor = path
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            raise LaunchError(f"run directory {path} cannot be created: {ancestor} is not a writable directory")


def _flag(name: str) -> str:
    """The launcher's flag of field ``name`` (its tyro name where the field renames it)."""
    for meta in getattr(get_type_hints(JobRequest, include_extras=True)[name], "__metadata__", ()):
        if isinstance(getattr(meta, "name", None), str):
            return f"--{meta.name}"
    return "--" + name.replace("_", "-")


# The launcher CLI's flag of each field (messages name both: Python callers know fields, shell users flags).
FLAGS = {f.name: _flag(f.name) for f in fields(JobRequest)} | {"algo": "ALGO", "trainer_args": "-- TRAINER ARGS"}
