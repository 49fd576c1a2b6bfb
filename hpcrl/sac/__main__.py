"""``python -m hpcrl.sac [--preset NAME] [--config FILE] [--seeds 0,1,2] [--nproc N] [--field value ...]``

Values: the preset (default holosoma) < ``--config FILE`` (YAML or JSON; a run's own config.json is
accepted as written) < the other flags.

A config whose ranks cannot fit in this node's memory (replay, envs, batch, model; :mod:`hpcrl.sac.sizes`)
is refused (exit 2) naming the flag and a value that fits, before any rank starts.

A run dir that holds a previous run (checkpoints, metrics rows, policies) is refused (exit 2) unless
``--resume`` continues it or ``--overwrite`` replaces it (:mod:`hpcrl.run.rundir_reuse`).

Without a launcher and with ``--nproc N`` it spawns N local ranks (gloo); under ``srun`` or
``torchrun`` every task runs one rank (the bootstrap reads the launcher's variables).

Exit codes: 0 done, 2 bad configuration (one line, whichever rank found it), 65 (sysexits
EX_DATAERR) the env returned a non-finite reward or observation (``--nonfinite error``; one line
naming env, rank and step, whichever rank met it, under ``--nproc`` too), 1 a rank failed (the message names
the rank that failed first) or stopped responding (every other rank exits 1 within
``--heartbeat-timeout-s``, naming it), 75 stopped by SIGUSR2/SIGTERM after writing a checkpoint
(resume with ``--resume``; the sbatch script requeues on 75), 74 (sysexits EX_IOERR) a checkpoint or
metrics write failed on the disk (one line naming the path and the free space; free space, then
``--resume``), 130 interrupted twice.

With ``--nproc N`` the parent forwards SIGTERM/SIGUSR2 to its ranks, and Ctrl-C as SIGTERM: signal
the pid you see (``kill``, systemd, docker) or the process group, the ranks checkpoint and the
command exits 75. A second Ctrl-C kills the ranks without a checkpoint (exit 130). The ranks die
with the parent.
"""

from __future__ import annotations

import dataclasses
import signal
import sys

from hpcrl.run.cli import cli, exit_code, flag_value, run_exit
from hpcrl.core.config_check import ConfigError
from hpcrl.run.config_file import load_config_file
from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_DISK, EXIT_NONFINITE
from hpcrl.run.rundir import RunDirError
from hpcrl.run.rundir_reuse import check_start, overwrite
from hpcrl.sac.sizes import check_sac, local_ranks

from .config import PRESETS, RESOLVED_KEYS, SACConfig, preset, seed_runs

PROG = "python -m hpcrl.sac"


def parse(argv: list[str]) -> SACConfig:
    """Flags over ``--config FILE`` over ``--preset NAME`` (default holosoma) over the dataclass defaults.
    ``--preset`` and ``--config`` are read first (they set the defaults the other flags are parsed
    against) and are also ordinary fields, so ``--help`` lists them."""
    help_only = "-h" in argv or "--help" in argv
    config = "" if help_only else (flag_value(argv, "--config") or "")
    # "resume" and "overwrite" are skipped too: a run's config.json records what *it* was started with;
    # rerunning a config starts fresh (and is refused on a run dir in use) unless the flag is passed again.
    ignore = RESOLVED_KEYS | {"config", "resume", "overwrite"}
    values = load_config_file(config, SACConfig, ignore=ignore) if config else {}
    name = ("holosoma" if help_only else flag_value(argv, "--preset")) or values.pop("preset", None) or "holosoma"
    values.pop("preset", None)
    if name not in PRESETS:
        raise ConfigError(f"--preset {name}: must be one of {', '.join(sorted(PRESETS))}; e.g. --preset pendulum")
    try:
        default = dataclasses.replace(preset(name), **values, config=config)
    except TypeError as err:  # unreachable for checked keys; kept one line
        raise ConfigError(f"--config {config}: {err}") from None
    return cli(SACConfig, argv, PROG, default=default,
               description=f"FastSAC, data parallel. Values: preset < --config file < flags "
                           f"(presets: {', '.join(sorted(PRESETS))}). Exit codes: 0 done, 2 bad configuration, "
                           f"{EXIT_NONFINITE} non-finite env data, {EXIT_DISK} a disk write failed (full, I/O "
                           "error), 1 a rank failed or stopped responding, 75 stopped after a "
                           "checkpoint (--resume), 130 interrupted twice.")


def _run(cfg: SACConfig) -> list[dict]:
    # heavy: after every refusal that needs no torch
    from hpcrl.comm import check_local_gpus, cuda_count, detect_launch, spawn
    from hpcrl.comm.prefork import prefork

    from .run import plan, train

    if cfg.nproc > 1:
        prefork()  # the ranks' server: a fork of this process while it holds imports only
        plan(cfg, cfg.nproc)  # fail before spawning anything
        check_local_gpus(cfg.nproc, cfg.device, cuda_count())
        check_sac(cfg, cfg.nproc, cfg.nproc, preset(cfg.preset), local_rank=None)  # every rank's memory
        # spawn forwards stop signals to the ranks while they run (they checkpoint and stop) and puts
        # these back afterwards: once the ranks are done, a late signal changes nothing (also between
        # the seeds of --seeds; the process exits when the last one is done).
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        return spawn(train, cfg.nproc, args=(cfg,), timeout_s=None, preload=[train.__module__])
    # one process, or one rank of srun / torchrun: before its rendezvous, so no rank of this node has
    # allocated anything while another one reads the memory left
    launch = detect_launch()
    plan(cfg, launch.world_size)
    ranks = min(local_ranks(), launch.world_size)  # 1 alone, whatever an salloc shell's variables say
    check_sac(cfg, launch.world_size, ranks, preset(cfg.preset), local_rank=launch.local_rank)
    return [train(cfg)]


def _one_launched_process() -> bool:
    """This process is the run's only one or spawns its ranks (else rank 0 carries out --overwrite)."""
    from hpcrl.comm import detect_launch

    return detect_launch().world_size == 1


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
        cfg.check()  # --seeds and every range, before the first run starts
        runs = seed_runs(cfg)
        for run in runs:  # every rank launched by srun / torchrun asks too, before its rendezvous
            check_start(run.run_dir, run.resume, run.resume_missing, run.overwrite)
    except (ConfigError, RunDirError) as err:
        print(f"hpcrl.sac: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    for i, run in enumerate(runs):
        if len(runs) > 1:
            print(f"hpcrl.sac: seed {run.seed} ({i + 1}/{len(runs)}) into {run.run_dir}", file=sys.stderr, flush=True)
        code = _main_one(run)
        if code:
            return code  # a failed or stopped seed stops the sweep (--resume continues it, seed by seed)
    return 0


def _main_one(cfg: SACConfig) -> int:
    try:
        if cfg.overwrite and _one_launched_process():
            overwrite(cfg.run_dir)  # right before this seed: an aborted sweep leaves the later seeds' runs
        return run_exit(_run(cfg))
    except (Exception, KeyboardInterrupt) as err:  # one line and its exit code; a bug keeps its traceback
        code = exit_code(err, "hpcrl.sac")
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
