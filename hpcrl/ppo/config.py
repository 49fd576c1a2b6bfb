"""Detached PPO configuration: one typed dataclass; every field is a command-line flag (tyro)."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.config_check import DEVICE, MAX_SEED, MAX_TIMEOUT_S, Check, ConfigError, flag, show
from hpcrl.conventions import DEFAULT_MAKERS, DEFAULT_TRAINERS

MAX_LAG = 64
"""Largest --lag: every version of staleness keeps batches_per_step more experience batches in flight per
trainer (and their weights' versions alive); beyond this it is a memory leak, not an overlap."""
MAX_CREDITS = 1024
"""Largest (lag + 1) x batches_per_step: experience batches in flight per trainer."""
MIN_BUCKET_MB = 1e-4
"""Smallest --bucket-mb (about 100 bytes): below it a publish becomes one broadcast per few values (0 hung)."""


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value



@dataclass
class DetachedConfig:
    workload: str = "cartpole"
    """"cartpole" (discrete vector-env PPO), "swingup" (continuous), "lm" (token-level LM PPO), or
    ``package.module:Class``; no whitespace or control characters."""
    makers: int = DEFAULT_MAKERS
    """Experience-maker ranks (>= 1)."""
    trainers: int = DEFAULT_TRAINERS
    """Trainer ranks (>= 1)."""
    trainer_device: str = "auto"
    """Trainers' device: "auto" (CUDA when a GPU is visible), "cpu", "cuda" or "cuda:K". On CUDA a rank gets
    cuda:LOCAL_RANK under srun/torchrun (cuda:0 with one GPU per task), cuda:(rank mod GPUs) when spawned
    locally; trainers need a GPU each."""
    maker_device: str = "auto"
    """Makers' device, same choices. Any mix with --trainer-device works: experience crosses on the host
    plane, weights by NCCL broadcast when trainer 0 and every maker have GPUs of their own, else by gloo
    staged through host memory (e.g. a maker sharing trainer 0's GPU)."""
    lag: int = 1
    """Staleness bound: trainers keep (lag + 1) x batches_per_step credits out, each requiring weights at
    least as new as the trainer's version when it was granted. 0 = synchronous (generate <-> train barrier).
    In [0, 64], and (lag + 1) x batches_per_step <= 1024: the credits bound the experience in memory."""
    max_lag: int | None = None
    """Safety cap: batches older than this many versions are dropped and counted (default: lag); >= lag."""
    batches_per_step: int = 1
    """Experience batches every trainer consumes per PPO update (the same on every trainer); >= 1."""
    total_steps: int = 100
    """PPO updates (= policy versions) to run (>= 1)."""
    target_return: float | None = None
    """Stop early once the mean episode return of a step reaches this (vector-env workloads); finite."""
    bucket_mb: float = 16.0
    """Weight publishes travel in buckets of this many MiB; finite, >= 1e-4 (about 100 bytes)."""
    seed: int = 0
    """In [0, 2**31 - 1]."""
    run_dir: str = "runs/ppo"
    """Non-empty path without control characters."""
    resume: bool = False
    resume_missing: str = "error"
    """With --resume and no usable checkpoint in run_dir: "error" refuses (exit 2), "fresh" starts a new run
    and says so (what the sbatch scripts pass: a job requeued before its first checkpoint starts over)."""
    timeout_s: float = 120.0
    """Longest wait for anything (experience, credits, weights, collectives) before failing with a named peer;
    in (0, 604800] seconds (at most a week)."""
    heartbeat_timeout_s: float = 15.0
    """A peer whose heartbeat stalls this long is dead (makers: dropped; trainers: the run fails). In
    [1, timeout_s]: at least two heartbeats (every 0.5 s), and no longer than any wait it should explain."""
    threads: int = 1
    """torch intra-op threads per rank (>= 1)."""
    checkpoint_every: int = 0
    """PPO updates between trainer checkpoints (0: only at the end; >= 0)."""
    workload_args: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for the workload, e.g. ``--workload-args num_envs 16 rollout_len 64``
    (keys are identifiers; values are Python literals; anything else is a string)."""
    ppo_args: dict[str, str] = field(default_factory=dict)
    """Overrides of the workload's PPO hyper-parameters (PPOConfig fields), e.g. ``--ppo-args lr 1e-3``."""

    def check(self) -> None:
        """Every value against its documented range, before any rank starts: :class:`ConfigError` (a
        ValueError) with one line naming the flag, the bad value, the valid range and a value that works
        (the world size against --trainers + --makers is :func:`hpcrl.ppo.run.validate`'s)."""
        c = Check(self)
        c.text("workload", spaces=False)
        c.integer("makers", 1, hint="experience-maker ranks")
        c.integer("trainers", 1, hint="trainer ranks")
        for name in ("trainer_device", "maker_device"):
            if not isinstance(getattr(self, name), str) or not DEVICE.fullmatch(getattr(self, name)):
                c.fail(name, "one of auto, cpu, cuda or cuda:K")
        c.integer("lag", 0, MAX_LAG, hint="staleness in policy versions; each one keeps more experience in flight")
        if self.max_lag is not None:
            c.integer("max_lag", self.lag, hint=f"not below --lag {self.lag}; unset = --lag",
                      fix=f"e.g. --max-lag {self.lag}, or leave it unset")
        c.integer("batches_per_step", 1, hint="experience batches per PPO update")
        credits = (self.lag + 1) * self.batches_per_step
        if credits > MAX_CREDITS:
            c.fail("batches_per_step", f"<= {MAX_CREDITS // (self.lag + 1)} with --lag {self.lag} ((lag + 1) x "
                   f"batches_per_step = {credits} experience batches in flight per trainer; at most {MAX_CREDITS})",
                   "lower --batches-per-step or --lag")
        c.integer("total_steps", 1, hint="PPO updates")
        if self.target_return is not None:
            c.real("target_return", hint="a mean episode return to stop at",
                   fix="e.g. --target-return 475, or leave it unset to run every step")
        c.real("bucket_mb", MIN_BUCKET_MB, hint="MiB per weight bucket; smaller splits a publish into millions")
        c.integer("seed", 0, MAX_SEED)
        c.text("run_dir")
        c.boolean("resume")
        if self.resume_missing not in ("error", "fresh"):
            c.fail("resume_missing", "one of error, fresh")
        c.real("timeout_s", 0.0, MAX_TIMEOUT_S, lo_open=True, hint="seconds")
        c.real("heartbeat_timeout_s", 1.0, hint="seconds; two heartbeats are 1 s")
        if not self.heartbeat_timeout_s <= self.timeout_s:
            c.fail("heartbeat_timeout_s", f"<= --timeout-s {show(self.timeout_s)} (a dead peer is named by its "
                   "heartbeat before a wait gives up)", "lower it or raise --timeout-s")
        c.integer("threads", 1, hint="torch threads per rank")
        c.integer("checkpoint_every", 0, hint="PPO updates between checkpoints; 0 = only at the end")
        for name in ("workload_args", "ppo_args"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
                c.fail(name, "pairs KEY VALUE with identifier keys", f"e.g. {flag(name)} num_envs 16")

    def workload_kwargs(self) -> dict[str, Any]:
        return {k: _literal(v) for k, v in self.workload_args.items()}

    def ppo_kwargs(self) -> dict[str, Any]:
        return {k: _literal(v) for k, v in self.ppo_args.items()}

    def bucket_numel(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per weight bucket (``bucket_mb``)."""
        return max(1, int(self.bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())

    @property
    def stale_cap(self) -> int:
        return self.lag if self.max_lag is None else self.max_lag
