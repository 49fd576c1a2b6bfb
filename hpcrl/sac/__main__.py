"""``python -m hpcrl.sac [--preset NAME] [--nproc N] [--field value ...]``

Without a launcher and with ``--nproc N`` it spawns N local ranks (gloo); under ``srun`` or
``torchrun`` every task runs one rank (the bootstrap reads the launcher's variables).

Exit codes: 0 done, 2 bad configuration, 1 a rank failed, 75 stopped by SIGUSR2/SIGTERM after
writing a checkpoint (resume with ``--resume``; the sbatch script requeues on 75).
"""

from __future__ import annotations

import signal
import sys

import tyro

from hpcrl.comm import DistSetupError, SpawnError, StopRequest, check_local_gpus, cuda_count, spawn
from hpcrl.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED

from .config import PRESETS, SACConfig, preset
from .train import ConfigError, plan, train


def parse(argv: list[str]) -> SACConfig:
    name = "holosoma"
    if "--preset" in argv:
        i = argv.index("--preset")
        if i + 1 >= len(argv):
            raise SystemExit(f"--preset needs a value: one of {sorted(PRESETS)}")
        name = argv[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    try:
        default = preset(name)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return tyro.cli(SACConfig, default=default, args=argv,
                    description=f"FastSAC, data parallel (preset {name!r}; presets: {', '.join(sorted(PRESETS))})")


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    try:
        if cfg.nproc > 1:
            plan(cfg, cfg.nproc)  # fail before spawning anything
            check_local_gpus(cfg.nproc, cfg.device, cuda_count())
            # The ranks checkpoint and stop on SIGUSR2/SIGTERM; the parent only waits for them
            # (send the signal to the process group: kill -USR2 -<pgid>).
            for sig in StopRequest.SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            rows = spawn(train, cfg.nproc, args=(cfg,), timeout_s=None)
        else:
            rows = [train(cfg)]
    except (ConfigError, DistSetupError) as err:
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SpawnError as err:  # a local rank failed: its message names the rank and carries its traceback
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_STOPPED if any(row.get("preempted") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
