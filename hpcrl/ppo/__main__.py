"""``python -m hpcrl.ppo --workload cartpole --makers 2 --trainers 1 --run-dir DIR``

Without a launcher it spawns ``makers + trainers`` local ranks (gloo). Under ``srun``/``torchrun``
each task takes its role from its rank: trainers ``[0, T)``, makers after.
A run dir that holds a previous run is refused (exit 2) unless ``--resume`` continues it or
``--overwrite`` replaces it (:mod:`hpcrl.run.rundir_reuse`).
Exit codes: 0 done, 2 bad configuration (one line, whichever rank found it), 1 a rank failed (the
message names the rank that failed first), 75 stopped by SIGUSR2/SIGTERM after the trainers wrote a
checkpoint (resume with ``--resume``), 130 interrupted twice.

Spawned locally, the parent forwards SIGTERM/SIGUSR2 to the ranks, and Ctrl-C as SIGTERM (a second
Ctrl-C kills them without a checkpoint); the ranks die with the parent. A maker that dies is
dropped and the run goes on, as under a launcher (a warning line names it); a trainer that dies
stops the run.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import TYPE_CHECKING

from hpcrl.run.cli import exit_code, flag_value, run_exit, switch_value
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import EXIT_BAD_CONFIG
from hpcrl.run.rundir import RunDirError
from hpcrl.run.rundir_reuse import check_start, overwrite

if TYPE_CHECKING:  # bound by _torch_side() once the refusals that need no torch have passed
    from hpcrl.comm import check_local_gpus, cuda_count, detect_launch, spawn
    from hpcrl.comm.devices import resolve_kind
    from hpcrl.comm.prefork import prefork

    from .config import DetachedConfig
    from hpcrl.comm.heartbeat import PeerLost
    from .run import build_workload, train, validate
    from .workloads import shared_imports

_TORCH_SIDE = {"check_local_gpus": "hpcrl.comm", "cuda_count": "hpcrl.comm", "detect_launch": "hpcrl.comm",
               "spawn": "hpcrl.comm", "resolve_kind": "hpcrl.comm.devices", "prefork": "hpcrl.comm.prefork",
               "shared_imports": "hpcrl.ppo.workloads", "PeerLost": "hpcrl.comm.heartbeat",
               "build_workload": "hpcrl.ppo.run", "train": "hpcrl.ppo.run", "validate": "hpcrl.ppo.run"}
"""Names this module uses after its refusals, from modules that import torch: loaded on first use, as
module globals (so that a test may replace one, e.g. ``spawn``)."""


def __getattr__(name: str):
    if name not in _TORCH_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_TORCH_SIDE[name]), name)
    return value


def _torch_side() -> None:
    """Bind every name of :data:`_TORCH_SIDE` not bound yet (a replaced one stays)."""
    for name in _TORCH_SIDE:
        if name not in globals():
            __getattr__(name)

DEFAULT_RUN_DIR = "runs/ppo"
"""DetachedConfig.run_dir's default (hpcrl.ppo.config imports torch; a test keeps the two equal)."""


def check_run_dir_early(argv: list[str]) -> None:
    """The run-dir refusal from the raw flags, before torch is imported (which takes 20-30 s on a loaded
    node): :class:`RunDirError` when :func:`check_start` would refuse what the flags say. Anything the
    flag parser would reject itself is left to it (checked again after parsing, with the parsed values)."""
    if "-h" in argv or "--help" in argv:
        return
    try:
        run_dir = flag_value(argv, "--run-dir") or DEFAULT_RUN_DIR
        resume_missing = flag_value(argv, "--resume-missing") or "error"
        resume, replace = switch_value(argv, "--resume"), switch_value(argv, "--overwrite")
    except ConfigError:
        return
    if resume_missing in ("error", "fresh") and not (resume and replace):
        check_start(run_dir, resume, resume_missing, replace)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_run_dir_early(argv)
        from .config import parse_args  # torch

        cfg = parse_args(argv)
        cfg.check()  # every range, before anything is built or spawned
        # every rank launched by srun / torchrun asks too, before its rendezvous (no rank has the lock yet)
        check_start(cfg.run_dir, cfg.resume, cfg.resume_missing, cfg.overwrite)
    except (ConfigError, RunDirError) as err:  # one line
        print(f"hpcrl.ppo: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    _torch_side()
    try:
        if cfg.overwrite and detect_launch().world_size == 1:  # else trainer 0 does it, holding the lock
            overwrite(cfg.run_dir)
        return run_exit(_run(cfg))
    except (Exception, KeyboardInterrupt) as err:  # one line and its exit code; a bug keeps its traceback
        code = exit_code(err, "hpcrl.ppo", failures=(PeerLost,))
        if code is None:
            raise
        return code


def _run(cfg: DetachedConfig) -> list[dict]:
    spawns = detect_launch().source == "single" and cfg.makers + cfg.trainers > 1
    if spawns:  # the ranks' server: a fork of this process while it holds imports only (no workload yet)
        for module in shared_imports(cfg.workload):
            importlib.import_module(module)
        prefork()
    workload, _ = build_workload(cfg)  # fail on a bad workload or device before starting any process
    for role in ("trainer", "maker"):
        resolve_kind(getattr(cfg, f"{role}_device"), cuda_count(), f"--{role}-device")
    if not spawns:
        return [train(cfg)]
    validate(cfg, cfg.makers + cfg.trainers)
    # Spawned ranks get cuda:(rank mod GPUs); makers may share GPUs, trainers (one NCCL group) may not.
    check_local_gpus(cfg.trainers, cfg.trainer_device, cuda_count(), "--trainer-device", "--trainers")
    # spawn forwards stop signals to the ranks while they run and restores these afterwards.
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    world = cfg.makers + cfg.trainers
    return spawn(train, world, args=(cfg,), timeout_s=None, num_threads=cfg.threads,
                 expendable=range(cfg.trainers, world),  # trainers drop dead makers and go on
                 preload=[train.__module__, *workload.rank_modules()])


def _exit(code: int) -> None:
    """Leave without interpreter teardown. After a maker or trainer was lost, a receive thread may still
    be blocked on it inside gloo, and cannot be cancelled; tearing the process groups down under it at
    interpreter exit can abort the process (rc -6) after a run that succeeded. Everything that matters
    (metrics, checkpoints, TensorBoard) is closed and flushed by then; the forkserver's socket dir is
    removed here (the run's scratch dir went with :func:`hpcrl.comm.spawn`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    rank_start = sys.modules.get("hpcrl.comm.rank_start")  # loaded once ranks were spawned from here
    if rank_start is not None:
        rank_start.remove_socket_dir()  # multiprocessing's exit hook would have; os._exit skips it
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
