"""python -m hpcrl.launch ALGO [--nodes N] [--gpus-per-node G] [--partition P] [--time MIN] ... -- TRAINER ARGS

Submits `python -m hpcrl.<ALGO> TRAINER ARGS` through submitit (Slurm when sbatch exists, else this
host), one rank per task and one task per GPU, and prints the job id, the run directory and the log
paths; --dry-run prints the batch script instead. Exit codes: 0 submitted, 2 a request that cannot
run (the message says why, in one line).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Annotated

import tyro

from hpcrl.run.cli import cli
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import EXIT_BAD_CONFIG

from .errors import LaunchError
from .request import JobRequest, trainer_algos

PROG = "python -m hpcrl.launch"


@dataclass(frozen=True)
class LaunchCommand:
    """The launcher's command line: the trainer, the job (every :class:`JobRequest` field but the
    trainer's), where it runs."""

    algo: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="ALGO")]
    """The trainer: python -m hpcrl.<algo>."""
    request: Annotated[JobRequest, tyro.conf.OmitArgPrefixes,
                       tyro.conf.arg(help="The job and the trainer's run directory.")] = field(default_factory=JobRequest)
    local: bool = False
    """Run on this host (submitit's local executor)."""
    slurm: bool = False
    """Require Slurm."""
    dry_run: bool = False
    """Print the sbatch script, submit nothing."""

    def where(self) -> bool | None:
        """``submit``'s ``local``: True, False, or None (Slurm when sbatch exists)."""
        if self.local and self.slurm:
            raise LaunchError("--local --slurm: --local runs on this host, --slurm requires Slurm; pass one of them")
        return True if self.local else False if self.slurm else None


def parse(argv: list[str]) -> tuple[LaunchCommand, JobRequest]:
    """The command and its request; everything after ``--`` belongs to the trainer, untouched."""
    split = argv.index("--") if "--" in argv else len(argv)
    description = __doc__.split("\n\n")[1] + f" Trainers: {', '.join(trainer_algos())}."
    cmd = cli(LaunchCommand, argv[:split], PROG, description=description)
    return cmd, dataclasses.replace(cmd.request, algo=cmd.algo, trainer_args=tuple(argv[split + 1:]))


def main(argv: list[str] | None = None) -> int:
    from .submit import submit_request  # submitit: only once the command line parsed

    try:
        cmd, request = parse(sys.argv[1:] if argv is None else argv)
        sub = submit_request(request, local=cmd.where(), dry_run=cmd.dry_run)
    except (LaunchError, ConfigError) as err:
        print(f"hpcrl.launch: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(sub.sbatch if cmd.dry_run else sub.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
