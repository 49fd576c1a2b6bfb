"""Detached PPO configuration: one typed dataclass; every field is a command-line flag (tyro)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.conventions import DEFAULT_MAKERS, DEFAULT_TRAINERS


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
    """"cartpole" (discrete vector-env PPO), "swingup" (continuous), "lm" (token-level LM PPO)."""
    makers: int = DEFAULT_MAKERS
    trainers: int = DEFAULT_TRAINERS
    trainer_device: str = "auto"
    """Trainers' device: "auto" (CUDA when a GPU is visible), "cpu" or "cuda". On CUDA a rank gets
    cuda:LOCAL_RANK under srun/torchrun (cuda:0 with one GPU per task), cuda:(rank mod GPUs) when spawned
    locally; trainers need a GPU each."""
    maker_device: str = "auto"
    """Makers' device, same choices. Any mix with --trainer-device works: experience crosses on the host
    plane, weights by NCCL broadcast when trainer 0 and every maker have GPUs of their own, else by gloo
    staged through host memory (e.g. a maker sharing trainer 0's GPU)."""
    lag: int = 1
    """Staleness bound: trainers keep (lag + 1) x batches_per_step credits out, each requiring weights at
    least as new as the trainer's version when it was granted. 0 = synchronous (generate <-> train barrier)."""
    max_lag: int | None = None
    """Safety cap: batches older than this many versions are dropped and counted (default: lag)."""
    batches_per_step: int = 1
    """Experience batches every trainer consumes per PPO update (the same on every trainer)."""
    total_steps: int = 100
    """PPO updates (= policy versions) to run."""
    target_return: float | None = None
    """Stop early once the mean episode return of a step reaches this (vector-env workloads)."""
    bucket_mb: float = 16.0
    """Weight publishes travel in buckets of this many MiB."""
    seed: int = 0
    run_dir: str = "runs/ppo"
    resume: bool = False
    timeout_s: float = 120.0
    """Longest wait for anything (experience, credits, weights, collectives) before failing with a named peer."""
    heartbeat_timeout_s: float = 15.0
    """A peer whose heartbeat stalls this long is dead (makers: dropped; trainers: the run fails)."""
    threads: int = 1
    checkpoint_every: int = 0
    """PPO updates between trainer checkpoints (0: only at the end)."""
    workload_args: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for the workload, e.g. ``--workload-args num_envs 16 rollout_len 64``
    (values are Python literals; anything else is a string)."""
    ppo_args: dict[str, str] = field(default_factory=dict)
    """Overrides of the workload's PPO hyper-parameters (PPOConfig fields), e.g. ``--ppo-args lr 1e-3``."""

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
