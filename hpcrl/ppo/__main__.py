"""``python -m hpcrl.ppo --workload cartpole --makers 2 --trainers 1 --run-dir DIR``

Without a launcher it spawns ``makers + trainers`` local ranks (gloo). Under ``srun``/``torchrun``
each task takes its role from its rank: trainers ``[0, T)``, makers after.
Exit codes: 0 done, 2 bad configuration (one line, whichever rank found it), 1 a rank failed (the
message names the rank that failed first), 75 stopped by SIGUSR2/SIGTERM after the trainers wrote a
checkpoint (resume with ``--resume``), 130 interrupted twice.

Spawned locally, the parent forwards SIGTERM/SIGUSR2 to the ranks, and Ctrl-C as SIGTERM (a second
Ctrl-C kills them without a checkpoint); the ranks die with the parent. A maker that dies is
dropped and the run goes on, as under a launcher (a warning line names it); a trainer that dies
stops the run.
"""

from __future__ import annotations

import os
import signal
import sys

from hpcrl.comm import SpawnError, check_local_gpus, cuda_count, detect_launch, spawn
from hpcrl.comm.devices import resolve_kind
from hpcrl.comm.local import SpawnConfigError, is_config_error
from hpcrl.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED

from .config import ConfigError, parse_args
from .liveness import PeerLost
from .run import build_workload, train, validate

EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C twice


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:  # tyro could not parse a flag: its message, one line
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        cfg.check()  # every range, before anything is built or spawned
        build_workload(cfg)  # fail on a bad workload or device before starting any process
        for role in ("trainer", "maker"):
            resolve_kind(getattr(cfg, f"{role}_device"), cuda_count(), f"--{role}-device")
        if detect_launch().source == "single" and cfg.makers + cfg.trainers > 1:
            validate(cfg, cfg.makers + cfg.trainers)
            # Spawned ranks get cuda:(rank mod GPUs); makers may share GPUs, trainers (one NCCL group) may not.
            check_local_gpus(cfg.trainers, cfg.trainer_device, cuda_count(), "--trainer-device", "--trainers")
            # spawn forwards stop signals to the ranks while they run and restores these afterwards.
            for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            world = cfg.makers + cfg.trainers
            rows = spawn(train, world, args=(cfg,), timeout_s=None, num_threads=cfg.threads,
                         expendable=range(cfg.trainers, world))  # trainers drop dead makers and go on
        else:
            rows = [train(cfg)]
    except SpawnConfigError as err:  # a rank found it: one line, however many ranks did
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (SpawnError, PeerLost) as err:
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("hpcrl.ppo: interrupted: stopped without a checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # ConfigError, DistSetupError, RunDirError: exit 2, one line
        if not is_config_error(err):
            raise
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return EXIT_STOPPED if any(row and row.get("preempted") for row in rows) else 0


def _exit(code: int) -> None:
    """Leave without interpreter teardown. After a maker or trainer was lost, a receive thread may still
    be blocked on it inside gloo, and cannot be cancelled; tearing the process groups down under it at
    interpreter exit can abort the process (rc -6) after a run that succeeded. Everything that matters
    (metrics, checkpoints, TensorBoard) is closed and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
