"""``python -m hpcrl.ppo --workload cartpole --makers 2 --trainers 1 --run-dir DIR``

Without a launcher it spawns ``makers + trainers`` local ranks (gloo). Under ``srun``/``torchrun``
each task takes its role from its rank: trainers ``[0, T)``, makers after.
Exit codes: 0 done, 2 bad configuration, 1 a rank failed (the message names it), 75 stopped by
SIGUSR2/SIGTERM after the trainers wrote a checkpoint (resume with ``--resume``).
"""

from __future__ import annotations

import signal
import sys

import tyro

from hpcrl.comm import DistSetupError, SpawnError, StopRequest, check_local_gpus, cuda_count, detect_launch, spawn
from hpcrl.comm.devices import resolve_kind
from hpcrl.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED

from .config import DetachedConfig
from .liveness import PeerLost
from .run import ConfigError, build_workload, train, validate


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(DetachedConfig, args=sys.argv[1:] if argv is None else argv,
                   description="Detached PPO: experience makers and PPO trainers as separate process groups")
    try:
        build_workload(cfg)  # fail on a bad workload or device before starting any process
        for role in ("trainer", "maker"):
            resolve_kind(getattr(cfg, f"{role}_device"), cuda_count(), f"--{role}-device")
        if detect_launch().source == "single" and cfg.makers + cfg.trainers > 1:
            validate(cfg, cfg.makers + cfg.trainers)
            # Spawned ranks get cuda:(rank mod GPUs); makers may share GPUs, trainers (one NCCL group) may not.
            check_local_gpus(cfg.trainers, cfg.trainer_device, cuda_count(), "--trainer-device", "--trainers")
            for sig in StopRequest.SIGNALS:  # the ranks handle them; the parent only waits
                signal.signal(sig, signal.SIG_IGN)
            rows = spawn(train, cfg.makers + cfg.trainers, args=(cfg,), timeout_s=None, num_threads=cfg.threads)
        else:
            rows = [train(cfg)]
    except (ConfigError, DistSetupError) as err:
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (SpawnError, PeerLost) as err:
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_STOPPED if any(row.get("preempted") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
