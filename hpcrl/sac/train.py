"""FastSAC data-parallel training loop: one ``train()`` per rank.

Data path: env.step -> ReplayShard.add -> ReplayShard.sample -> FastSAC.update (losses ->
GradSync all-reduce -> optimizer step). Envs and replay are rank-local; parameters are broadcast
from rank 0 at start and after a resume; normaliser statistics are reduced once per env step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hpcrl import checkpoint
from hpcrl.comm import (DistContext, StopRequest, all_reduce_sum_, barrier, broadcast_, check_parameters_in_sync,
                        hosts, init_distributed, reduce_metrics, shutdown)
from hpcrl.envs import EpisodeStats, make_env
from hpcrl.metrics import RunLogger
from hpcrl.replay import ReplayShard

from .agent import FastSAC, UpdateNoise
from .config import SACConfig
from .normalizer import ObsNormalizer


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    """Global sizes split over the ranks."""

    world_size: int
    envs_per_rank: int
    batch_per_rank: int
    iterations: int  # vector-env steps; each collects num_envs transitions globally


def _nearest_multiples(value: int, world: int) -> str:
    low = (value // world) * world
    return ", ".join(str(v) for v in sorted({max(low, world), low + world}))


def plan(cfg: SACConfig, world_size: int) -> Layout:
    """Validate the global sizes against the world size (DESIGN.md, FastSAC contract 2)."""
    for name in ("num_envs", "batch_size", "total_env_steps", "num_updates", "policy_frequency", "buffer_size",
                 "n_step", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.num_envs % world_size:
        raise ConfigError(f"num_envs={cfg.num_envs} not divisible by world_size={world_size}; "
                          f"use e.g. --num-envs {_nearest_multiples(cfg.num_envs, world_size)}")
    if cfg.batch_size < world_size:
        raise ConfigError(f"batch_size={cfg.batch_size} < world_size={world_size}: every rank needs at least "
                          f"one sample per update; use --batch-size {world_size} or more")
    if cfg.batch_size % world_size:
        raise ConfigError(f"batch_size={cfg.batch_size} not divisible by world_size={world_size}; "
                          f"use e.g. --batch-size {_nearest_multiples(cfg.batch_size, world_size)}")
    if cfg.checkpoint_every and cfg.checkpoint_every % cfg.log_every:
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every} must be a multiple of log_every={cfg.log_every} "
                          "(a checkpoint lands on a metrics row so a resume repeats no partial window)")
    if cfg.n_step > cfg.buffer_size:
        raise ConfigError(f"n_step={cfg.n_step} exceeds buffer_size={cfg.buffer_size}")
    return Layout(world_size, cfg.num_envs // world_size, cfg.batch_size // world_size,
                  math.ceil(cfg.total_env_steps / cfg.num_envs))


def train(cfg: SACConfig) -> dict[str, float]:
    """Run (or resume) one rank of a FastSAC job; returns the final metrics row (all ranks)."""
    stop = StopRequest.install()  # first: a USR2 during start-up must stop cleanly too, not kill the rank
    torch.set_num_threads(cfg.threads)
    ctx = init_distributed(timeout_s=cfg.timeout_s, device=cfg.device)
    layout = plan(cfg, ctx.world_size)
    device = ctx.device
    rank, world = ctx.rank, ctx.world_size
    # Planes (hpcrl.comm.planes): gradients, parameters, normaliser statistics and checksums on the
    # device plane; metrics rows and the stop agreement on the host plane.
    data, control = ctx.device_plane, ctx.host_plane

    def sync_barrier(name: str) -> None:
        barrier(ctx, name)

    def reduce_sum(t: torch.Tensor) -> None:
        all_reduce_sum_([t], data)

    # Model init identical on every rank (then broadcast anyway); env and sampling streams per rank.
    torch.manual_seed(cfg.seed)
    env_seed = cfg.seed + rank * layout.envs_per_rank
    try:
        # gymnasium seeds sub-env i with seed + i: space the ranks so their streams never overlap.
        env = make_env(cfg.env, layout.envs_per_rank, device=device, seed=env_seed)
    except ValueError as err:  # unknown env name or bad size: a config problem, not a crash
        raise ConfigError(str(err)) from None
    if env.num_actions is not None:
        raise ConfigError(f"env {cfg.env!r} has discrete actions; FastSAC needs a continuous action space")
    agent = FastSAC(cfg, env.obs_dim, env.action_dim, env.action_low, env.action_high, device, plane=data)
    normalizer = ObsNormalizer(env.obs_dim, enabled=cfg.obs_normalization).to(device)
    if cfg.compile:
        agent.actor.compile()
        agent.critic.compile()
        agent.critic_target.compile()
    replay = ReplayShard(layout.envs_per_rank, cfg.buffer_size, env.obs_dim, env.action_dim, cfg.n_step,
                         cfg.gamma, device)
    generator = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + rank)
    stats = EpisodeStats(layout.envs_per_rank, device)
    obs = env.reset(seed=env_seed)
    low, high = env.action_low, env.action_high

    resume_from = checkpoint.latest(cfg.run_dir) if cfg.resume else None
    if resume_from is not None:
        learner, mine = checkpoint.load(resume_from, rank, world, device)
        agent.load_learner_state(learner["agent"])
        normalizer.load_state_dict(learner["normalizer"])
        replay.load_state_dict(mine["replay"])
        env.load_state_dict(mine["env"])
        stats.load_state_dict(mine["episode_stats"])
        generator.set_state(mine["generator"])
        obs = mine["obs"].to(device)
    broadcast_([t.data for t in agent.broadcast_tensors()] + [normalizer.count, normalizer.mean, normalizer.m2], data)

    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = {**dataclasses.asdict(cfg), "world_size": world, "envs_per_rank": layout.envs_per_rank,
                    "batch_per_rank": layout.batch_per_rank, "iterations": layout.iterations,
                    "launcher": ctx.source, "hosts": hosts(ctx)}
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        print(f"hpcrl.sac: {world} rank(s) via {ctx.source}, device {device}; global num_envs={cfg.num_envs} "
              f"({layout.envs_per_rank}/rank), global batch={cfg.batch_size} ({layout.batch_per_rank}/rank), "
              f"{layout.iterations} env steps x {cfg.num_envs} envs = {layout.iterations * cfg.num_envs} "
              f"transitions" + (f"; resuming from {resume_from}" if resume_from else ""), flush=True)
    start_iter = agent.counters.iteration
    logger = RunLogger(run_dir, rank == 0, layout.iterations * cfg.num_envs,
                       resume_env_steps=start_iter * cfg.num_envs if resume_from else 0)

    window: dict[str, list[torch.Tensor]] = {}
    window_start = time.time()
    window_iters = 0
    row: dict[str, float] = {}
    for it in range(start_iter, layout.iterations):
        normalizer.update(obs, reduce_sum if ctx.is_distributed else None)
        if it < cfg.random_steps:
            action = low + (high - low) * torch.rand(obs.shape[0], env.action_dim, generator=generator,
                                                     device=device)
        else:
            action = agent.actor.act(normalizer(obs), generator)
        result = env.step(action)
        replay.add(obs, action, result.reward * cfg.reward_scale, result.next_obs, result.terminated,
                   result.truncated)
        stats.update(result)
        obs = result.obs

        if it >= cfg.learning_starts:
            for _ in range(cfg.num_updates):
                batch = replay.sample(layout.batch_per_rank, generator)
                batch = batch._replace(obs=normalizer(batch.obs), next_obs=normalizer(batch.next_obs))
                noise = UpdateNoise.draw(layout.batch_per_rank, env.action_dim, generator, device)
                for key, value in agent.update(batch, noise).items():
                    window.setdefault(key, []).append(value)
                if cfg.check_sync_every and agent.counters.critic_steps % cfg.check_sync_every == 0:
                    check_parameters_in_sync(
                        [(f"actor.{n}", p) for n, p in agent.actor.named_parameters()]
                        + [(f"critic.{n}", p) for n, p in agent.critic.named_parameters()]
                        + [("log_alpha", agent.log_alpha)], data)
        agent.counters.iteration = it + 1
        window_iters += 1

        if (it + 1) % cfg.log_every == 0 or it + 1 == layout.iterations:
            row = _log_row(agent, stats, window, window_iters, time.time() - window_start, cfg, ctx)
            logger.log(row)
            window, window_iters, window_start = {}, 0, time.time()
            if it + 1 < layout.iterations and stop.agreed(control):
                _save(cfg, ctx, agent, normalizer, replay, env, stats, generator, obs, sync_barrier)
                if rank == 0:
                    print(f"hpcrl.sac: stop requested ({stop.reason}); checkpoint at env step "
                          f"{agent.counters.iteration * cfg.num_envs} written, resume with --resume", flush=True)
                logger.close()
                shutdown()
                return {**row, "preempted": 1.0}
        if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0 and it + 1 < layout.iterations:
            _save(cfg, ctx, agent, normalizer, replay, env, stats, generator, obs, sync_barrier)

    if cfg.eval_episodes:
        row.update(evaluate(cfg, agent, normalizer, device, ctx))
        logger.log(row)
    logger.close()
    shutdown()  # rank 0 usually hosts the rendezvous store: it leaves only after every peer is done
    return row


def _log_row(agent: FastSAC, stats: EpisodeStats, window: dict[str, list[torch.Tensor]], iters: int,
             seconds: float, cfg: SACConfig, ctx: DistContext) -> dict[str, float]:
    episodes = stats.pop()
    count = episodes.count
    metrics = {key: torch.stack(values).float().mean() for key, values in window.items() if values}
    for key in ("critic_loss", "actor_loss", "alpha_loss", "entropy"):
        metrics.setdefault(key, torch.tensor(float("nan")))
    metrics["episode_return"] = episodes.return_sum / count.clamp(min=1)  # raw env rewards
    metrics["episode_length"] = episodes.length_sum / count.clamp(min=1)
    metrics["alpha"] = agent.alpha
    weights = {"episode_return": count, "episode_length": count}
    out = reduce_metrics(metrics, ctx.host_plane, weights=weights)
    env_steps = agent.counters.iteration * cfg.num_envs
    return {"env_steps": env_steps, "updates": agent.counters.critic_steps,
            "actor_updates": agent.counters.actor_steps, **{k: round(v, 6) for k, v in sorted(out.items())},
            "sps": round(iters * cfg.num_envs / max(seconds, 1e-9), 1)}


def _save(cfg, ctx, agent, normalizer, replay, env, stats, generator, obs, sync_barrier) -> None:
    learner = {"agent": agent.learner_state(), "normalizer": normalizer.state_dict()} if ctx.rank == 0 else None
    rank_state = {"replay": replay.state_dict(), "env": env.state_dict(), "episode_stats": stats.state_dict(),
                  "generator": generator.get_state(), "obs": obs}
    checkpoint.save(cfg.run_dir, agent.counters.iteration, ctx.rank, ctx.world_size, learner, rank_state,
                    sync_barrier, keep=cfg.keep_checkpoints)


@torch.no_grad()
def evaluate(cfg: SACConfig, agent: FastSAC, normalizer: ObsNormalizer, device: torch.device,
             ctx: DistContext) -> dict[str, float]:
    """Deterministic policy on fresh envs (seed offset so they differ from training); mean return over ranks."""
    env = make_env(cfg.env, cfg.eval_episodes, device=device, seed=10_000 + cfg.seed + ctx.rank)
    obs = env.reset()
    stats = EpisodeStats(cfg.eval_episodes, device)
    finished = torch.zeros(cfg.eval_episodes, dtype=torch.bool, device=device)
    returns = torch.zeros(cfg.eval_episodes, device=device)
    for _ in range(env.max_episode_steps or 1000):
        result = env.step(agent.actor.act(normalizer(obs), deterministic=True))
        done, episode_return, _ = stats.update(result)
        returns = torch.where(done & ~finished, episode_return, returns)
        finished |= done
        obs = result.obs
        if bool(finished.all()):
            break
    return {"eval_return": reduce_metrics({"r": returns.mean()}, ctx.host_plane)["r"]}
