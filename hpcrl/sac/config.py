"""FastSAC configuration: one typed dataclass; every field is a command-line flag (tyro)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass
class SACConfig:
    """Defaults follow holosoma's FastSACConfig (research/fastsac.md §2.1) unless a preset says otherwise."""

    # -- run -----------------------------------------------------------------------------------------
    env: str = "pendulum"
    """Environment name for hpcrl.envs.make_env ("pendulum", "cartpole_swingup", "gym:HalfCheetah-v5", ...)."""
    num_envs: int = 64
    """GLOBAL number of parallel envs; must divide by the world size."""
    total_env_steps: int = 100_000
    """GLOBAL env transitions to collect (rounded up to a multiple of num_envs)."""
    run_dir: str = "runs/fastsac"
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir/checkpoints."""
    seed: int = 0
    device: str = "auto"
    """"auto" = CUDA when a GPU is visible, else cpu; or "cuda", "cpu", "cuda:K". On CUDA a rank gets
    cuda:LOCAL_RANK under srun/torchrun (cuda:0 with one GPU per task) and cuda:(rank mod GPUs) under --nproc."""
    nproc: int = 1
    """Spawn this many local ranks (NCCL on GPUs: at most one rank per GPU; gloo on CPU); 1 = run in this
    process (or one rank under srun/torchrun)."""
    threads: int = 1
    """torch intra-op threads per rank (oversubscribing cores made updates 10-30x slower here)."""
    timeout_s: float = 300.0
    """Timeout of every collective and rendezvous."""

    # -- data ----------------------------------------------------------------------------------------
    batch_size: int = 8192
    """GLOBAL batch per update; every rank samples batch_size / world_size."""
    buffer_size: int = 1024
    """Replay capacity per env (transitions)."""
    n_step: int = 1
    gamma: float = 0.97
    learning_starts: int = 10
    """Env steps (vector steps) before the first update."""
    random_steps: int = 0
    """Env steps with uniformly random actions at the start (exploration warm-up)."""
    obs_normalization: bool = True

    # -- updates -------------------------------------------------------------------------------------
    num_updates: int = 8
    """Critic (+alpha) updates per env step."""
    policy_frequency: int = 4
    """Actor update when (critic_step + 1) % policy_frequency == 0."""
    tau: float = 0.125
    critic_lr: float = 3e-4
    actor_lr: float = 3e-4
    alpha_lr: float = 3e-4
    weight_decay: float = 1e-3
    alpha_init: float = 1e-3
    autotune_alpha: bool = True
    target_entropy_ratio: float = 0.0
    """target entropy = -ratio * action_dim."""
    grad_sync: Literal["flat", "view", "ddp"] = "flat"
    bf16: bool = False
    """bf16 autocast for forward passes (parameters and optimiser state stay fp32)."""
    compile: bool = False
    """torch.compile the actor and critic."""

    # -- networks ------------------------------------------------------------------------------------
    actor_hidden: int = 512
    critic_hidden: int = 768
    num_q: int = 2
    num_atoms: int = 101
    v_min: float = -20.0
    v_max: float = 20.0
    layer_norm: bool = True
    log_std_min: float = -5.0
    log_std_max: float = 0.0
    reward_scale: float = 1.0
    """Rewards are multiplied by this before storage (keeps returns inside [v_min, v_max])."""

    # -- bookkeeping ---------------------------------------------------------------------------------
    log_every: int = 10
    """Env steps between metrics rows."""
    checkpoint_every: int = 500
    """Env steps between checkpoints (a multiple of log_every); 0 disables periodic checkpoints."""
    keep_checkpoints: int = 2
    check_sync_every: int = 1000
    """Critic updates between cross-rank parameter checksums (0 disables)."""
    eval_episodes: int = 0
    """Deterministic evaluation episodes per env at the end (0 = none)."""


PRESETS: dict[str, dict] = {
    # holosoma's defaults for massively parallel humanoid locomotion.
    "holosoma": {},
    # Small networks and a Pendulum-sized value range: solves Pendulum on a CPU in about a minute.
    "pendulum": dict(
        env="pendulum", num_envs=8, total_env_steps=8_000, batch_size=256, buffer_size=4096, gamma=0.98,
        learning_starts=64, random_steps=64, num_updates=4, policy_frequency=2, tau=0.01, critic_lr=1e-3,
        actor_lr=1e-3, alpha_lr=1e-3, weight_decay=0.0, alpha_init=0.1, target_entropy_ratio=1.0,
        actor_hidden=128, critic_hidden=128, v_min=-100.0, v_max=10.0, reward_scale=0.1, log_std_max=2.0,
        log_every=25, checkpoint_every=500, eval_episodes=4,
    ),
}


def preset(name: str, **overrides) -> SACConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(SACConfig(), **{**PRESETS[name], **overrides})
