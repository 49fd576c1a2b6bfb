"""What a FastSAC rank runs with (:class:`Run`), what changes from one vector step to the next
(:class:`LoopState`), and how a checkpoint saves and restores both."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hpcrl.run import checkpoint
from hpcrl.comm import DistContext, StopRequest, all_reduce_sum_, barrier
from hpcrl.envs import EpisodeStats
from hpcrl.run.metrics import RunLogger
from hpcrl.replay import ReplayShard, Sampler

from . import reshard
from .agent import FastSAC
from .config import SACConfig
from .events import Events
from .layout import Layout
from .normalizer import ObsNormalizer

# SACConfig fields a resume may change: how long it runs, where and how fast, how often it logs,
# checkpoints and checks. Every other field is the run's identity: a checkpoint resumes only into the
# run that wrote it (the first differing field is named). The world size is not part of it: a resume
# at another world size re-deals the envs (:mod:`hpcrl.sac.reshard`).
RESUMABLE_FIELDS = frozenset({"total_env_steps", "run_dir", "resume", "overwrite", "resume_missing", "device",
                              "nproc", "threads", "timeout_s", "heartbeat_timeout_s", "grad_average", "bf16", "amp",
                              "compile", "compile_cache", "log_every", "checkpoint_every", "keep_checkpoints", "check_replicas_every", "eval_episodes",
                              "eval_every", "preset", "config", "seeds", "nonfinite", "wandb_project", "wandb_mode",
                              # how the update is computed, not what: checkpoints are the same either way
                              "flat_params", "batched_critic", "overlap_grad_average", "shared_memory"})


# Identity fields added later, with the value every older run had: left out at that value, so older
# checkpoints keep resuming.
LATER_FIELDS = {"cdq": False}


def run_identity(cfg: SACConfig, world_size: int | None = None) -> dict[str, Any]:
    """The run's identity; ``world_size`` is accepted for older callers and left out (runs reshard)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in RESUMABLE_FIELDS
              and not (f.name in LATER_FIELDS and getattr(cfg, f.name) == LATER_FIELDS[f.name])}
    return {"seed": fields.pop("seed"), **fields}


@dataclass
class Parts:
    """A rank's training objects: built once, saved by a checkpoint, loaded by a resume."""

    env: Any  # an hpcrl.envs vector env
    agent: FastSAC
    normalizer: ObsNormalizer
    critic_normalizer: ObsNormalizer | None  # over the privileged critic observations; None: the actor's
    replay: ReplayShard
    stats: EpisodeStats
    generator: torch.Generator  # the rank's stream: random actions, update noise (replay samples: Run.sampler)

    @property
    def has_critic_obs(self) -> bool:
        return bool(self.env.critic_obs_dim)


@dataclass
class Run:
    """What a rank's loop runs with; fixed for the run."""

    cfg: SACConfig
    ctx: DistContext
    layout: Layout
    parts: Parts
    logger: RunLogger
    stop: StopRequest
    events: Events
    reduce_sum: Callable[[torch.Tensor], None] | None = field(init=False)
    """Sum over the ranks on the device plane, in place; None in one process."""
    sampler: Sampler = field(init=False)
    """The rank's replay minibatches (indices drawn in the kernel); a checkpoint saves its (seed, offset)."""

    def __post_init__(self) -> None:
        plane = self.ctx.device_plane
        self.reduce_sum = (lambda t: all_reduce_sum_([t], plane)) if self.ctx.is_distributed else None
        # Per rank like Parts.generator, salted: on CUDA that generator is Philox too, and the two streams
        # must not coincide.
        seed = (self.cfg.seed * 1_000_003 + self.ctx.rank) ^ 0x9E3779B97F4A7C15
        self.sampler = Sampler(self.parts.replay, self.layout.batch_per_rank, seed)


@dataclass
class Window:
    """The vector steps since the last metrics row; a checkpoint taken mid-window (a stop) carries it, so
    a resumed run logs the same rows."""

    metrics: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    iters: int = 0
    dropped: int = 0  # transitions with non-finite data replaced (--nonfinite skip)
    start: float = field(default_factory=time.time)


@dataclass
class LoopState:
    """What changes from one vector step to the next, besides the parts (the step count is the agent's)."""

    obs: torch.Tensor
    critic_obs: torch.Tensor | None
    best: float = -math.inf  # best eval return so far: rank 0's (only it writes best/)
    window: Window = field(default_factory=Window)
    row: dict[str, float] = field(default_factory=dict)  # the last metrics row
    sampler: dict[str, int] | None = None  # a resumed run's Run.sampler state, loaded when its loop starts


def restore(parts: Parts, found: checkpoint.Restored, device: torch.device, rank: int) -> LoopState:
    """Load a checkpoint into ``parts``; returns the loop state it carries. One written by another
    world size is re-dealt to this rank first (:func:`resharded`)."""
    learner, mine = found.learner, found.rank_state
    if found.rank_states is not None:
        mine = resharded(parts, found, rank)
    parts.agent.load_learner_state(learner["agent"])
    parts.normalizer.load_state_dict(learner["normalizer"])
    if parts.critic_normalizer is not None:
        parts.critic_normalizer.load_state_dict(learner["critic_normalizer"])
    parts.replay.load_state_dict(mine["replay"])
    parts.env.load_state_dict(mine["env"])
    if mine.get("shared_state"):
        parts.env.load_shared_state({k: v.to(device) for k, v in mine["shared_state"].items()})
    parts.stats.load_state_dict(mine["episode_stats"])
    parts.generator.set_state(mine["generator"])
    state = LoopState(mine["obs"].to(device), mine["critic_obs"].to(device) if parts.has_critic_obs else None,
                      best=float(learner.get("best_eval_return", -math.inf)) if rank == 0 else -math.inf,
                      sampler=mine.get("sampler"))
    if "window" in mine:  # a checkpoint taken mid-window (a stop): continue it
        state.window = Window({k: list(v.to(device).unbind(0)) for k, v in mine["window"].items()},
                              int(mine["window_iters"]), int(mine["dropped"]))
    return state


def resharded(parts: Parts, found: checkpoint.Restored, rank: int) -> dict[str, Any]:
    """This rank's state re-dealt from the old ranks' files (:mod:`hpcrl.sac.reshard`); rank 0 says so."""
    cfg = parts.agent.cfg
    world = cfg.num_envs // parts.replay.num_envs
    # the env's generator (pure-torch envs) lives on the run's device too, so one factory serves both
    device = parts.generator.device
    target = reshard.Target(cfg.num_envs, found.world_size, world, rank, cfg.seed, found.step,
                            lambda seed: torch.Generator(device).manual_seed(seed).get_state())
    mine = reshard.rank_state({r: _cpu(s) for r, s in (found.rank_states or {}).items()}, target)
    if rank == 0:
        print(f"hpcrl: resharded {found.world_size} → {world} ranks: {parts.replay.num_envs} envs per rank, "
              f"batch {cfg.batch_size // world} per rank", flush=True)
    return mine


def _cpu(value: Any) -> Any:
    """A rank file's tree on the host (slicing and concatenation there; the loads move it to the device)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return {k: _cpu(v) for k, v in value.items()} if isinstance(value, dict) else value


def save(run: Run, state: LoopState) -> None:
    """Collective: a checkpoint of every rank at the current vector step."""
    cfg, ctx, p = run.cfg, run.ctx, run.parts
    # best_eval_return: what a resumed run's best/ must beat (rank 0's learner state; -inf = no eval yet)
    learner = ({"agent": p.agent.learner_state(), "normalizer": p.normalizer.state_dict(),
                "best_eval_return": state.best} if ctx.rank == 0 else None)
    if learner is not None and p.critic_normalizer is not None:
        learner["critic_normalizer"] = p.critic_normalizer.state_dict()
    extra = {"critic_obs": state.critic_obs, "shared_state": p.env.shared_state(),
             "window": {k: torch.stack(v) for k, v in state.window.metrics.items() if v},
             "window_iters": state.window.iters, "dropped": state.window.dropped}
    rank_state = {"replay": p.replay.state_dict(), "env": p.env.state_dict(), "episode_stats": p.stats.state_dict(),
                  "generator": p.generator.get_state(), "sampler": run.sampler.state_dict(), "obs": state.obs,
                  **{k: v for k, v in extra.items() if v is not None}}
    checkpoint.save(cfg.run_dir, p.agent.counters.vector_steps, ctx.rank, ctx.world_size, learner, rank_state,
                    functools.partial(barrier, ctx), keep=cfg.keep_checkpoints,
                    identity=run_identity(cfg, ctx.world_size))
