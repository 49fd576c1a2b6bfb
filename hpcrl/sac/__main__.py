"""``python -m hpcrl.sac [--preset NAME] [--nproc N] [--field value ...]``

Without a launcher and with ``--nproc N`` it spawns N local ranks (gloo); under ``srun`` or
``torchrun`` every task runs one rank (the bootstrap reads the launcher's variables).
"""

from __future__ import annotations

import signal
import sys

import tyro

from hpcrl.dist import DistSetupError, SpawnError, spawn

from .config import PRESETS, SACConfig, preset
from .train import ConfigError, StopRequest, plan, train


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
            # The ranks checkpoint and stop on SIGUSR2/SIGTERM; the parent only waits for them
            # (send the signal to the process group: kill -USR2 -<pgid>).
            for sig in StopRequest.SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            spawn(train, cfg.nproc, args=(cfg,), timeout_s=None)
        else:
            train(cfg)
    except (ConfigError, DistSetupError) as err:
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return 2
    except SpawnError as err:  # a local rank failed: its message names the rank and carries its traceback
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
