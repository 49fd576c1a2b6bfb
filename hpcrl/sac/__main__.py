"""``python -m hpcrl.sac [--preset NAME] [--nproc N] [--field value ...]``

Without a launcher and with ``--nproc N`` it spawns N local ranks (gloo); under ``srun`` or
``torchrun`` every task runs one rank (the bootstrap reads the launcher's variables).

Exit codes: 0 done, 2 bad configuration (one line, whichever rank found it), 1 a rank failed (the
message names the rank that failed first), 75 stopped by SIGUSR2/SIGTERM after writing a checkpoint
(resume with ``--resume``; the sbatch script requeues on 75), 130 interrupted twice.

With ``--nproc N`` the parent forwards SIGTERM/SIGUSR2 to its ranks, and Ctrl-C as SIGTERM: signal
the pid you see (``kill``, systemd, docker) or the process group, the ranks checkpoint and the
command exits 75. A second Ctrl-C kills the ranks without a checkpoint (exit 130). The ranks die
with the parent.
"""

from __future__ import annotations

import signal
import sys

import tyro

from hpcrl.comm import SpawnError, check_local_gpus, cuda_count, spawn
from hpcrl.comm.local import SpawnConfigError, is_config_error
from hpcrl.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED

from .config import PRESETS, SACConfig, preset
from .train import plan, train

EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C twice


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
            # spawn forwards stop signals to the ranks while they run (they checkpoint and stop) and
            # restores these afterwards: once the ranks are done, a late signal changes nothing.
            for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            rows = spawn(train, cfg.nproc, args=(cfg,), timeout_s=None)
        else:
            rows = [train(cfg)]
    except SpawnConfigError as err:  # a rank found it: one line, however many ranks did
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SpawnError as err:  # a local rank failed: the message names the first and carries its traceback
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("hpcrl.sac: interrupted: stopped without a checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # ConfigError, DistSetupError, RunDirError: exit 2, one line
        if not is_config_error(err):
            raise
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return EXIT_STOPPED if any(row and row.get("preempted") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
