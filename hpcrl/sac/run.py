"""FastSAC data-parallel training: ``train(cfg)`` per rank sets the run up and runs its loop.

Data path: env.step -> ReplayShard.add -> replay.Sampler.sample (indices drawn in the kernel) ->
FastSAC.update (losses -> GradAverager all-reduce -> optimizer step); the loop's steps are in :mod:`hpcrl.sac.loop`. Parameters
are broadcast from rank 0 at start and after a resume; a checkpoint taken mid metrics window
carries the window, so a resumed run logs the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Iterator

import torch

from hpcrl.run import checkpoint, rundir
from hpcrl.comm import DistContext, StopRequest, broadcast_, hosts, init_distributed, shutdown
from hpcrl.comm.bootstrap import explain_failure, unwatch_peers, watch_peers
from hpcrl.comm.native_log import divert_native_stderr, restore_native_stderr
from hpcrl.envs import EpisodeStats, make_env
from hpcrl.run.metrics import RunLogger
from hpcrl.replay import ReplayShard

from .agent import FastSAC
from .config import RESOLVED_KEYS, ConfigError, SACConfig
from .events import Events, ignore
from .layout import Layout, plan
from .loop import reduce_shared_state, run_loop
from .nonfinite import NonFiniteEnvData
from .normalizer import ObsNormalizer
from .state import RESUMABLE_FIELDS, LoopState, Parts, Run, restore, run_identity

__all__ = ["RESOLVED_KEYS", "RESUMABLE_FIELDS", "ConfigError", "Layout", "NonFiniteEnvData", "RunDirConfigError",
           "plan", "reduce_shared_state", "run_identity", "train"]

# Keys of RUN_DIR/config.json that the run resolved (not SACConfig fields): --config skips them, so a
# run's own config.json reruns as written.


class RunDirConfigError(ConfigError, rundir.RunDirError):
    """The run directory refused the run (in use by another run, a checkpoint of another run, nothing to
    resume, no usable checkpoint): a ConfigError for the CLI (exit 2), a RunDirError for launchers."""


@contextlib.contextmanager
def _run_dir_errors() -> Iterator[None]:
    try:
        yield
    except rundir.RunDirError as err:
        if isinstance(err, ConfigError):
            raise
        raise RunDirConfigError(str(err)) from None


def train(cfg: SACConfig, events: Events = ignore) -> dict[str, float]:
    """Run (or resume) one rank of a FastSAC job; ``events`` sees what happens (:mod:`hpcrl.sac.events`).
    Returns the final metrics row (all ranks)."""
    stop = StopRequest.install()  # first: a USR2 during start-up must stop cleanly too, not kill the rank
    cfg.check()  # before anything starts: a bad --threads or --device would fail less clearly below
    torch.set_num_threads(cfg.threads)
    ctx = init_distributed(timeout_s=cfg.timeout_s, device=cfg.device, shared_memory=cfg.shared_memory)
    layout = plan(cfg, ctx.world_size)
    with _run_dir_errors():  # before any rank touches the run dir; refused: exit 2 on every rank
        lock = rundir.claim(cfg.run_dir, ctx)  # rank 0 holds it for the life of the run
    if ctx.is_distributed:  # C++ frames (c10d, gloo, NCCL) to RUN_DIR/logs/rank<N>.log; Python's lines stay here
        divert_native_stderr(Path(cfg.run_dir) / "logs", ctx.rank)
    # From here on a frozen peer is named and this rank exits within --heartbeat-timeout-s (shutdown ends the watch).
    watch_peers(cfg.heartbeat_timeout_s)
    try:
        return _train(cfg, stop, ctx, layout, events)
    except RuntimeError as err:  # a collective that failed because a peer vanished: the watch names the peer
        explain_failure(err)
        raise
    finally:
        unwatch_peers()
        restore_native_stderr()
        lock.release()


def _train(cfg: SACConfig, stop: StopRequest, ctx: DistContext, layout: Layout, events: Events) -> dict[str, float]:
    parts, state = _build(cfg, ctx, layout)
    run_dir = Path(cfg.run_dir)
    found = _resume(cfg, ctx) if cfg.resume else None
    if found is not None:
        state = restore(parts, found, ctx.device, ctx.rank)
    elif ctx.rank == 0:  # a fresh start (the entry point refused a run dir holding another run): clear leftovers
        checkpoint.clear(run_dir)
    _broadcast_learner(parts, ctx)
    if ctx.rank == 0:
        _write_config(cfg, ctx, layout, found.path if found is not None else None)
    start = parts.agent.counters.vector_steps
    if start >= layout.vector_steps:  # a finished run resumed as is
        if ctx.rank == 0:
            print(f"hpcrl.sac: {run_dir} already finished ({start * cfg.num_envs} of "
                  f"{layout.vector_steps * cfg.num_envs} transitions); nothing left to do (raise --total-env-steps "
                  "to train longer)", flush=True)
        shutdown()
        return {}
    logger = RunLogger(run_dir, ctx.rank == 0, layout.vector_steps * cfg.num_envs,
                       resume_env_steps=start * cfg.num_envs if found is not None else 0,
                       wandb_project=cfg.wandb_project or None, wandb_mode=cfg.wandb_mode,
                       wandb_config=dataclasses.asdict(cfg))
    return run_loop(Run(cfg, ctx, layout, parts, logger, stop, events), state)


def _build(cfg: SACConfig, ctx: DistContext, layout: Layout) -> tuple[Parts, LoopState]:
    """The rank's env, learner, replay and streams, freshly initialised; the first observations."""
    device = ctx.device
    # Model init identical on every rank (then broadcast anyway); env and sampling streams per rank.
    torch.manual_seed(cfg.seed)
    env_seed = cfg.seed + ctx.rank * layout.envs_per_rank
    env = _make_env(cfg, layout.envs_per_rank, device, env_seed)
    cdim = env.critic_obs_dim
    agent = FastSAC(cfg, env.obs_dim, env.action_dim, env.action_low, env.action_high, device,
                    plane=ctx.device_plane, critic_obs_dim=cdim)
    normalizer = ObsNormalizer(env.obs_dim, enabled=cfg.obs_normalization).to(device)
    critic_normalizer = ObsNormalizer(cdim, enabled=cfg.obs_normalization).to(device) if cdim else None
    if cfg.compile:  # acting; the critics run only inside the update, which --compile captures whole
        # dynamic: one graph for the envs' batch and the eval's (Dynamo would compile a static one first)
        agent.actor.compile(dynamic=True)
    replay = ReplayShard(layout.envs_per_rank, cfg.buffer_size, env.obs_dim, env.action_dim, cfg.n_step,
                         cfg.gamma, device, critic_obs_dim=cdim or 0)
    generator = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + ctx.rank)
    stats = EpisodeStats(layout.envs_per_rank, device)
    obs = env.reset(seed=env_seed)
    critic_obs = env.observe_critic() if cdim else None
    return Parts(env, agent, normalizer, critic_normalizer, replay, stats, generator), LoopState(obs, critic_obs)


def _make_env(cfg: SACConfig, num_envs: int, device: torch.device, seed: int):
    try:
        # gymnasium seeds sub-env i with seed + i: the caller spaces the ranks so their streams never overlap.
        env = make_env(cfg.env, num_envs, device=device, seed=seed)
    except ValueError as err:  # unknown env name or bad size: a config problem, not a crash
        raise ConfigError(str(err)) from None
    if env.num_actions is not None:
        raise ConfigError(f"env {cfg.env!r} has discrete actions; FastSAC needs a continuous action space")
    if cfg.symmetry and not env.has_symmetry:
        raise ConfigError(f"--symmetry: env {cfg.env!r} has no mirror maps (mirror_obs/mirror_action"
                          f"{'/mirror_critic_obs' if env.critic_obs_dim else ''}); drop --symmetry")
    return env


def _broadcast_learner(parts: Parts, ctx: DistContext) -> None:
    """Rank 0's parameters and normaliser statistics to every rank (device plane)."""
    buffers = [parts.normalizer.count, parts.normalizer.mean, parts.normalizer.m2]
    if parts.critic_normalizer is not None:
        buffers += [parts.critic_normalizer.count, parts.critic_normalizer.mean, parts.critic_normalizer.m2]
    broadcast_([t.data for t in parts.agent.broadcast_tensors()] + buffers, ctx.device_plane)


def _write_config(cfg: SACConfig, ctx: DistContext, layout: Layout, resume_from: Path | None) -> None:
    """RUN_DIR/config.json (the config with what the run resolved) and the start-up line. Rank 0."""
    world = ctx.world_size
    resolved = {**dataclasses.asdict(cfg), "world_size": world, "envs_per_rank": layout.envs_per_rank,
                "batch_per_rank": layout.batch_per_rank, "iterations": layout.vector_steps,  # config.json's name
                "launcher": ctx.source, "hosts": hosts(ctx)}
    rundir.write_text(Path(cfg.run_dir) / "config.json", json.dumps(resolved, indent=2))
    print(f"hpcrl.sac: {world} rank(s) via {ctx.source}, device {ctx.device}; global num_envs={cfg.num_envs} "
          f"({layout.envs_per_rank}/rank), global batch={cfg.batch_size} ({layout.batch_per_rank}/rank), "
          f"{layout.vector_steps} vector steps x {cfg.num_envs} envs = {layout.vector_steps * cfg.num_envs} "
          f"transitions" + (f"; resuming from {resume_from}" if resume_from else ""), flush=True)


def _resume(cfg: SACConfig, ctx: DistContext) -> checkpoint.Restored | None:
    """The newest checkpoint every rank can load (collective); None only with ``--resume-missing fresh``."""
    with _run_dir_errors():
        found = checkpoint.restore(cfg.run_dir, ctx.rank, ctx.world_size, ctx.device,
                                   identity=run_identity(cfg, ctx.world_size), agree=checkpoint.store_agree(ctx),
                                   reshard=True)  # another world size: envs re-dealt (hpcrl/sac/reshard.py)
        if found is None:
            checkpoint.fresh_or_refuse(cfg.run_dir, cfg.resume_missing, ctx.rank == 0, "hpcrl.sac")
        return found
