"""python -m hpcrl.launch ALGO [--nodes N] [--gpus-per-node G] [--partition P] [--time MIN] ... -- TRAINER ARGS

Submits `python -m hpcrl.<ALGO> TRAINER ARGS` through submitit (Slurm when sbatch exists, else this
host), one rank per task and one task per GPU, and prints the job id, the run directory and the log
paths; --dry-run prints the batch script instead. Exit codes: 0 submitted, 2 a request that cannot
run (the message says why).
"""

from __future__ import annotations

import argparse
import sys

from hpcrl.conventions import EXIT_BAD_CONFIG

from .errors import LaunchError
from .request import JobRequest, trainer_algos
from .submit import submit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcrl.launch", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algo", help=f"trainer: python -m hpcrl.<algo> ({', '.join(trainer_algos())})")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="one task (rank) per GPU; 0 = CPU ranks")
    p.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node (default: GPUs per node, or 1)")
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--partition", default=None, help="default: the cluster's default partition")
    p.add_argument("--time", type=int, default=JobRequest.time_min, dest="time_min", help="time limit in minutes (default %(default)s)")
    p.add_argument("--signal-delay", type=int, default=JobRequest.signal_delay_s, dest="signal_delay_s",
                   help="seconds before the time limit at which the ranks checkpoint and the job requeues "
                        "(default %(default)s)")
    p.add_argument("--run-dir", default=JobRequest.run_dir, help="%%j = job id (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--folder", default=JobRequest.folder, help="submitit folder: batch script, pickles, logs (default %(default)s)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", dest="local", action="store_const", const=True, default=None,
                       help="run on this host (submitit's local executor)")
    where.add_argument("--slurm", dest="local", action="store_const", const=False, help="require Slurm")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # everything after "--" belongs to the trainer, untouched
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])
    try:
        sub = submit(args.algo, argv[split + 1:], nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     tasks_per_node=args.tasks_per_node, partition=args.partition, time_min=args.time_min,
                     cpus_per_task=args.cpus_per_task, run_dir=args.run_dir, resume=args.resume,
                     folder=args.folder, signal_delay_s=args.signal_delay_s, local=args.local,
                     dry_run=args.dry_run)
    except LaunchError as err:
        print(f"hpcrl.launch: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(sub.sbatch if args.dry_run else sub.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
