"""Facts that trainers, the launcher and the sbatch scripts share. Torch-free on purpose.

``python -m hpcrl.launch`` and ``slurm/*.sbatch`` run where torch may not be importable (a login
node, the batch script before the job's environment is active), so what they must agree on with
the trainers lives here, once: exit codes, the detached-PPO rank layout and its default group
sizes, and the rendezvous-port rule. The sbatch scripts read them with
``python -m hpcrl.core.conventions NAME``.
"""

from __future__ import annotations

import sys

__all__ = [
    "DEFAULT_MAKERS",
    "DEFAULT_TRAINERS",
    "EXIT_BAD_CONFIG",
    "EXIT_DISK",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NONFINITE",
    "EXIT_STOPPED",
    "LAUNCHED_PID_ENV",
    "ppo_role",
    "rendezvous_port",
]

EXIT_FAILED = 1  # a rank failed; the message names it
EXIT_BAD_CONFIG = 2  # bad configuration, caught before (or while) ranks start
EXIT_STOPPED = 75  # sysexits EX_TEMPFAIL: stopped on request after a checkpoint; rerun with --resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C twice, the ranks killed without a checkpoint
EXIT_DISK = 74  # sysexits EX_IOERR: a write failed on the disk (full, I/O error); free space, then --resume
EXIT_NONFINITE = 65  # sysexits EX_DATAERR: the env returned NaN/inf (FastSAC --nonfinite error); fix the env

# Detached PPO: ranks [0, trainers) train, [trainers, trainers + makers) make experience.
DEFAULT_TRAINERS = 1
DEFAULT_MAKERS = 1
LAUNCHED_PID_ENV = "HPCRL_LAUNCHED_PID"  # set by the --nproc spawner: the pid of the command the user started


def ppo_role(rank: int, trainers: int, makers: int) -> str:
    """``"trainer"`` or ``"maker"``: the rank layout every detached-PPO launcher must follow."""
    if trainers < 1 or makers < 1:
        raise ValueError(f"detached PPO needs >= 1 trainer and >= 1 maker, got trainers={trainers}, makers={makers}")
    if not 0 <= rank < trainers + makers:
        raise ValueError(f"rank {rank} outside a world of {trainers + makers}")
    return "trainer" if rank < trainers else "maker"


def rendezvous_port(job_id: int, step_id: int = 0) -> int:
    """Rendezvous port of a Slurm step (or a submitit local job), derived from its ids so all tasks
    agree without talking and the steps of one job (a scaling sweep, concurrent ``srun &``) never
    share a port: 7919 is coprime to 10000, so steps 0..9999 of a job map to distinct ports in
    20000-29999."""
    return 20000 + (job_id + 7919 * step_id) % 10000


def _main(argv: list[str]) -> int:
    """``python -m hpcrl.core.conventions EXIT_STOPPED`` prints 75; ``rendezvous_port JOB [STEP]`` a port."""
    if not argv:
        print(f"usage: python -m hpcrl.core.conventions NAME [ARGS]; names: {', '.join(__all__)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    name, args = argv[0], argv[1:]
    value = globals().get(name) if name in __all__ else None
    if value is None:
        print(f"hpcrl.core.conventions: unknown name {name!r}; known: {', '.join(__all__)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if callable(value):
        try:
            value = value(*(int(a) for a in args))
        except (TypeError, ValueError) as err:
            print(f"hpcrl.core.conventions: {name}{tuple(args)}: {err}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
