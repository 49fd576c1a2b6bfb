"""One rank of a detached-PPO job: bootstrap, groups, role dispatch (the roles hold their loops)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import tyro

from hpcrl.run import checkpoint, rundir
from hpcrl.run.cli import spell_bools
from hpcrl.comm import StopRequest, detect_launch, init_distributed, shutdown
from hpcrl.comm.bootstrap import explain_failure, unwatch_peers, watch_peers
from hpcrl.comm.heartbeat import Heartbeat, liveness_store, remember_hosts
from hpcrl.comm.local import record_dropped
from hpcrl.comm.native_log import divert_native_stderr, restore_native_stderr
from hpcrl.core.conventions import ppo_role
from hpcrl.core.rundir_files import file_mode, narrowed_umask

from .config import HF_WORKLOADS, LM_WORKLOADS, ConfigError, DetachedConfig, is_plugin, tyro_call
from .events import Events, ignore
from .maker import Maker
from .plugins import plugin_class
from .role_planes import make_role_planes
from .topology import Topology
from .trainer import Trainer, run_identity
from .trainer_checkpoint import upgrade_identity
from .workload import PPOConfig, Workload
from .workload_plugin import as_workload

__all__ = ["ConfigError", "build_workload", "train", "validate"]


def build_workload(cfg: DetachedConfig) -> tuple[Workload, PPOConfig]:
    """The workload and its PPO hyper-parameters: a registered name built with ``cfg.env`` / ``cfg.lm``,
    or ``package.module:Class`` built from ``cfg.plugin_args`` parsed against its constructor (tyro) and
    brought onto the :class:`~hpcrl.ppo.workload.Workload` contract (:func:`~hpcrl.ppo.workload_plugin.as_workload`);
    then ``cfg.ppo``'s overrides on the workload's :meth:`default_config`."""
    if is_plugin(cfg.workload):
        cls = plugin_class(cfg.workload)
        prog = f"python -m hpcrl.ppo --workload {cfg.workload}"
        try:
            args = spell_bools(cls, list(cfg.plugin_args))
            workload = tyro_call(lambda: tyro.cli(cls, args=args, prog=prog), prog)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"--workload {cfg.workload}: {err}") from None
        workload = as_workload(workload, f"--workload {cfg.workload}")
    else:
        from .workloads import make_workload

        if cfg.workload in HF_WORKLOADS:  # the actor lands in RUN_DIR/hf/actor unless --hf.save-dir says
            options = {**cfg.hf.kwargs(), "save_dir": cfg.hf.save_dir or str(Path(cfg.run_dir) / "hf")}
        else:
            options = cfg.lm.kwargs() if cfg.workload in LM_WORKLOADS else cfg.env.kwargs()
        try:
            workload = make_workload(cfg.workload, **options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"--workload {cfg.workload}: {err}") from None
    ppo = workload.default_config()
    fields, extra = cfg.ppo.overrides()
    return workload, dataclasses.replace(ppo, **fields, extra={**ppo.extra, **extra})


def validate(cfg: DetachedConfig, world_size: int) -> Topology:
    """The rank layout, once ``cfg.check()`` passed (every range, lag <= max_lag): the world must hold it."""
    top = Topology(cfg.trainers, cfg.makers)
    if world_size != top.world_size:
        raise ConfigError(f"--trainers {cfg.trainers} + --makers {cfg.makers} = {top.world_size} ranks, but the "
                          f"launcher started {world_size}; start {top.world_size} tasks or change the counts")
    return top


def check_resumable(cfg: DetachedConfig, top: Topology) -> None:
    """``--resume`` checks every rank makes before any loads (manifests only, one verdict everywhere):
    another run's checkpoint, or nothing to resume, is a :class:`hpcrl.run.rundir.RunDirError` on every
    rank (exit 2), not a trainer failure the makers learn about later."""
    if checkpoint.preflight(cfg.run_dir, top.trainers, identity=run_identity(cfg), reshard=True,
                           upgrade=upgrade_identity(cfg)) is None \
            and cfg.resume_missing != "fresh":
        raise rundir.RunDirError(f"--resume: {checkpoint.nothing_to_resume(cfg.run_dir)}; run without --resume to "
                                 "start fresh, or pass --resume-missing fresh to start fresh whenever there is "
                                 "nothing to resume")


def train(cfg: DetachedConfig, events: Events = ignore) -> dict[str, float]:
    """Run one rank (its role from its rank: trainers ``[0, T)``, makers after); ``events`` sees what
    happens (:mod:`hpcrl.ppo.events`). Returns the trainer's final row, or the maker's totals. Every file
    the rank makes (DCP shards, exports too) is private from its creation (:func:`~hpcrl.run.rundir.file_mode`)."""
    with narrowed_umask(file_mode()):
        return _train(cfg, events)


def _train(cfg: DetachedConfig, events: Events) -> dict[str, float]:
    stop = StopRequest.install()  # makers only record it: trainers decide, then send STOP credits
    cfg.check()  # before anything starts: a bad --threads or device would fail less clearly below
    torch.set_num_threads(cfg.threads)
    try:
        role = ppo_role(detect_launch().rank, cfg.trainers, cfg.makers)
    except ValueError as err:  # a rank beyond trainers + makers: the launcher started too many
        raise ConfigError(f"{err}: --trainers {cfg.trainers} + --makers {cfg.makers} = "
                          f"{cfg.trainers + cfg.makers} ranks; start that many tasks or change the counts") from None
    flag = f"--{role}-device"
    ctx = init_distributed(timeout_s=cfg.timeout_s, device=getattr(cfg, f"{role}_device"), device_flag=flag,
                           world_device_plane=False)
    top = validate(cfg, ctx.world_size)
    workload, ppo = build_workload(cfg)
    # Every rank, before anything touches the run dir: trainer 0 (global rank 0) holds its lock for the
    # life of the run; a refusal (in use, another run's checkpoint, nothing to resume) is exit 2 everywhere.
    lock = rundir.claim(cfg.run_dir, ctx)
    if ctx.is_distributed:  # C++ frames (c10d, gloo) to the rank's log; the one-line reason stays here
        divert_native_stderr(Path(cfg.run_dir) / "logs", ctx.rank)
    try:
        if cfg.resume:
            check_resumable(cfg, top)
        groups = make_role_planes(ctx, top)  # every rank, same order: a torch.distributed rule
        remember_hosts(ctx)
        beat = Heartbeat(liveness_store(ctx.store, cfg.heartbeat_timeout_s), ctx.rank)
        if role == "trainer" and top.trainers > 1:
            # A trainer blocked in a collective or a shared-memory sum cannot notice a frozen peer trainer
            # itself: this watch ends the process with one line naming it (the trainers' loss ends the run).
            watch_peers(cfg.heartbeat_timeout_s, ranks=range(top.trainers), role="trainer", beat=False)
        try:
            if role == "maker":
                out = Maker(ctx, top, cfg, workload, groups, events).run()
                gone: list[int] = []
            else:
                trainer = Trainer(ctx, top, cfg, workload, ppo, groups, stop, events)
                out = trainer.run()
                gone = [top.maker_rank(m) for m in trainer.dead]
            # Trainer 0 waits for the live ranks only: a lost maker never reaches it, and one that freezes
            # from here on (its heartbeat, still beating through shutdown, stalls) is dropped, not waited for.
            makers = [top.maker_rank(m) for m in range(top.makers)]
            for rank in shutdown(gone=gone, expendable=makers, heartbeat_timeout_s=cfg.heartbeat_timeout_s):
                record_dropped(rank)
        except Exception as err:
            explain_failure(err)  # a collective that failed under a lost trainer: the watch's line names it
            raise
        finally:
            unwatch_peers()  # after an error (shutdown ended it otherwise): no watch outlives the run here
            beat.stop()
    finally:
        restore_native_stderr()
        lock.release()
    return out

