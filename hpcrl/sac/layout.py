"""A FastSAC run's global sizes split over its ranks (:func:`plan`), checked before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ConfigError, SACConfig


@dataclass(frozen=True)
class Layout:
    """Global sizes split over the ranks."""

    world_size: int
    envs_per_rank: int
    batch_per_rank: int
    vector_steps: int  # steps of all envs at once; each collects num_envs transitions globally


def _nearest_multiples(value: int, world: int) -> str:
    low = (value // world) * world
    return ", ".join(str(v) for v in sorted({max(low, world), low + world}))


def plan(cfg: SACConfig, world_size: int) -> Layout:
    """Validate the global sizes against the world size. The contract: ``num_envs`` and ``batch_size``
    are global, every rank runs ``num_envs / W`` envs and samples ``batch_size / W`` transitions per
    update, so W changes the speed of a run, not what it learns from. Call after ``cfg.check()`` (every
    field's range)."""
    if cfg.resume and (cfg.num_envs % world_size or cfg.batch_size % world_size):
        valid = [w for w in range(1, cfg.num_envs + 1) if cfg.num_envs % w == 0 and cfg.batch_size % w == 0]
        raise ConfigError(f"--resume with {world_size} ranks: this run's num_envs={cfg.num_envs} and "
                          f"batch_size={cfg.batch_size} split over {', '.join(map(str, valid))} ranks only")
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
