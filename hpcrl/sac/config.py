"""FastSAC configuration: one typed dataclass; every field is a command-line flag (tyro)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from hpcrl.config_check import DEVICE, MAX_SEED, MAX_TIMEOUT_S, Check, ConfigError

GradSyncMode = Literal["flat", "view", "ddp"]



@dataclass
class SACConfig:
    """Defaults follow holosoma's FastSACConfig (research/fastsac.md §2.1) unless a preset says otherwise."""

    # -- run -----------------------------------------------------------------------------------------
    env: str = "pendulum"
    """Environment name for hpcrl.envs.make_env ("pendulum", "cartpole_swingup", "gym:HalfCheetah-v5", ...);
    non-empty, no whitespace or control characters."""
    num_envs: int = 64
    """GLOBAL number of parallel envs (>= 1); must divide by the world size."""
    total_env_steps: int = 100_000
    """GLOBAL env transitions to collect (>= 1; rounded up to a multiple of num_envs)."""
    run_dir: str = "runs/fastsac"
    """Non-empty path without control characters."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir/checkpoints."""
    resume_missing: str = "error"
    """With --resume and no usable checkpoint in run_dir: "error" refuses (exit 2), "fresh" starts a new run
    and says so (what the sbatch scripts pass: a job requeued before its first checkpoint starts over)."""
    seed: int = 0
    """In [0, 2**31 - 1]."""
    device: str = "auto"
    """"auto" = CUDA when a GPU is visible, else cpu; or "cuda", "cpu", "cuda:K". On CUDA a rank gets
    cuda:LOCAL_RANK under srun/torchrun (cuda:0 with one GPU per task) and cuda:(rank mod GPUs) under --nproc."""
    nproc: int = 1
    """(>= 1) Spawn this many local ranks (NCCL on GPUs: at most one rank per GPU; gloo on CPU); 1 = run in this
    process (or one rank under srun/torchrun)."""
    threads: int = 1
    """(>= 1) torch intra-op threads per rank (oversubscribing cores made updates 10-30x slower here)."""
    timeout_s: float = 300.0
    """Timeout of every collective and rendezvous, in (0, 604800] seconds (at most a week)."""

    # -- data ----------------------------------------------------------------------------------------
    batch_size: int = 8192
    """GLOBAL batch per update (>= 1); every rank samples batch_size / world_size."""
    buffer_size: int = 1024
    """Replay capacity per env (transitions); >= n_step."""
    n_step: int = 1
    """n-step returns (>= 1)."""
    gamma: float = 0.97
    """Discount, in (0, 1]."""
    learning_starts: int = 10
    """Env steps (vector steps) before the first update (>= 0)."""
    random_steps: int = 0
    """Env steps with uniformly random actions at the start (exploration warm-up; >= 0)."""
    obs_normalization: bool = True

    # -- updates -------------------------------------------------------------------------------------
    num_updates: int = 8
    """Critic (+alpha) updates per env step (>= 1)."""
    policy_frequency: int = 4
    """Actor update when (critic_step + 1) % policy_frequency == 0 (>= 1)."""
    tau: float = 0.125
    """Soft target update rate, in (0, 1] (1 = copy the critic)."""
    critic_lr: float = 3e-4
    """> 0 and finite (so are the other learning rates)."""
    actor_lr: float = 3e-4
    """> 0 and finite."""
    alpha_lr: float = 3e-4
    """Learning rate of log(alpha): > 0 and finite."""
    weight_decay: float = 1e-3
    """AdamW weight decay of actor and critic, >= 0."""
    alpha_init: float = 1e-3
    """Initial entropy temperature, > 0 (its log is learned)."""
    autotune_alpha: bool = True
    target_entropy_ratio: float = 0.0
    """target entropy = -ratio * action_dim (any finite value)."""
    grad_sync: GradSyncMode = "flat"
    bf16: bool = False
    """bf16 autocast for forward passes (parameters and optimiser state stay fp32)."""
    compile: bool = False
    """torch.compile the actor and critic."""

    # -- networks ------------------------------------------------------------------------------------
    actor_hidden: int = 512
    """Width of the first hidden layer (then /2, /4): >= 4."""
    critic_hidden: int = 768
    """Width of the first hidden layer (then /2, /4): >= 4."""
    num_q: int = 2
    """Critic heads (>= 1)."""
    num_atoms: int = 101
    """C51 atoms of each head's return distribution, >= 2."""
    v_min: float = -20.0
    """Support of the return distribution: finite, v_min < v_max."""
    v_max: float = 20.0
    """Finite, > v_min."""
    layer_norm: bool = True
    log_std_min: float = -5.0
    """The actor's log-std range: finite, log_std_min < log_std_max."""
    log_std_max: float = 0.0
    """Finite, > log_std_min."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before storage (keeps returns inside [v_min, v_max]); finite, not 0."""

    # -- bookkeeping ---------------------------------------------------------------------------------
    log_every: int = 10
    """Env steps between metrics rows (>= 1)."""
    checkpoint_every: int = 500
    """Env steps between checkpoints (a multiple of log_every); 0 disables periodic checkpoints."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in run_dir/checkpoints (>= 1)."""
    check_sync_every: int = 1000
    """Critic updates between cross-rank parameter checksums (0 disables)."""
    eval_episodes: int = 0
    """Deterministic evaluation episodes per env at the end (0 = none)."""

    def check(self) -> None:
        """Every value against its documented range, before any rank starts: :class:`ConfigError` (a
        ValueError) with one line naming the flag, the bad value, the valid range and a value that works
        (world-size dependent checks, e.g. divisibility by the number of ranks, are
        :func:`hpcrl.sac.train.plan`'s)."""
        c = Check(self)
        c.text("env", spaces=False)
        c.integer("num_envs", 1, hint="parallel envs over all ranks")
        c.integer("total_env_steps", 1, hint="env transitions to collect")
        c.text("run_dir")
        c.boolean("resume")
        c.choice("resume_missing", {"error", "fresh"}.__contains__, "error, fresh")
        c.integer("seed", 0, MAX_SEED)
        c.choice("device", DEVICE.fullmatch, "auto, cpu, cuda or cuda:K")
        c.integer("nproc", 1, hint="local ranks to spawn; 1 = this process")
        c.integer("threads", 1, hint="torch threads per rank")
        c.real("timeout_s", 0.0, MAX_TIMEOUT_S, lo_open=True, hint="seconds")
        c.integer("batch_size", 1, hint="global batch per update")
        c.integer("n_step", 1, hint="n-step returns")
        c.integer("buffer_size", max(1, self.n_step),
                  hint=f"replay transitions per env; not below --n-step {self.n_step}",
                  fix=f"e.g. --buffer-size {max(self.n_step, SACConfig.buffer_size)}, or a smaller --n-step")
        c.real("gamma", 0.0, 1.0, lo_open=True, hint="discount")
        c.integer("learning_starts", 0, hint="env steps before the first update")
        c.integer("random_steps", 0, hint="env steps with random actions")
        c.boolean("obs_normalization")
        c.integer("num_updates", 1, hint="critic updates per env step")
        c.integer("policy_frequency", 1, hint="critic updates per actor update")
        c.real("tau", 0.0, 1.0, lo_open=True, hint="soft target update rate")
        for name in ("critic_lr", "actor_lr", "alpha_lr"):
            c.real(name, 0.0, lo_open=True, hint="learning rate")
        c.real("weight_decay", 0.0, hint="AdamW weight decay")
        c.real("alpha_init", 0.0, lo_open=True, hint="initial entropy temperature; its log is learned")
        c.boolean("autotune_alpha")
        c.real("target_entropy_ratio", hint="target entropy = -ratio * action_dim")
        c.choice("grad_sync", get_args(GradSyncMode).__contains__, ", ".join(get_args(GradSyncMode)))
        c.boolean("bf16")
        c.boolean("compile")
        for name in ("actor_hidden", "critic_hidden"):
            c.integer(name, 4, hint="hidden widths are it, /2 and /4")
        c.integer("num_q", 1, hint="critic heads")
        c.integer("num_atoms", 2, hint="atoms of the return distribution")
        c.real("v_min")
        c.real("v_max")
        c.ordered("v_min", "v_max", "the critic's support of returns")
        c.boolean("layer_norm")
        c.real("log_std_min")
        c.real("log_std_max")
        c.ordered("log_std_min", "log_std_max", "the actor's log-std range")
        c.real("reward_scale", hint="rewards are multiplied by it")
        if self.reward_scale == 0:
            c.fail("reward_scale", "finite and not 0 (0 erases every reward)", "e.g. --reward-scale 1")
        c.integer("log_every", 1, hint="env steps between metrics rows")
        c.integer("checkpoint_every", 0, hint="env steps between checkpoints; 0 = only at the end")
        c.integer("keep_checkpoints", 1, hint="checkpoints kept")
        c.integer("check_sync_every", 0, hint="critic updates between checksums; 0 = never")
        c.integer("eval_episodes", 0, hint="evaluation episodes per env; 0 = none")


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
