"""FastSAC configuration: one typed dataclass; every field is a command-line flag (tyro).

Units: a *vector step* is one ``env.step`` of all ``num_envs`` envs at once (``num_envs`` transitions);
``--log-every``, ``--checkpoint-every``, ``--eval-every``, ``--learning-starts`` and ``--random-steps``
count vector steps. ``--total-env-steps`` and the ``env_steps`` column of metrics.jsonl count
transitions (vector steps x num_envs).

Where values come from, lowest first: the preset (``--preset``), the config file (``--config``), the
command-line flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from hpcrl.core.config_check import DEVICE, MAX_SEED, MAX_TIMEOUT_S, Check, ConfigError

from .presets import PRESETS

GradAverageMode = Literal["flat", "view", "ddp"]
NonFiniteMode = Literal["error", "skip"]
WandbMode = Literal["online", "offline", "disabled"]
AmpMode = Literal["none", "bf16", "fp16"]

RESOLVED_KEYS = frozenset({"world_size", "envs_per_rank", "batch_per_rank", "iterations", "launcher", "hosts"})
"""Keys a run's config.json adds to the fields (what the run resolved); a --config file may hold them."""


@dataclass
class SACConfig:
    """Defaults follow holosoma's FastSACConfig (docs/holosoma.md) unless a preset says otherwise."""

    preset: str = "holosoma"
    """Start from this preset's values (holosoma, pendulum, halfcheetah, halfcheetah-cpu, hopper-cpu,
    playground); --config and the other flags override it."""
    config: str = ""
    """YAML or JSON file of field values (e.g. the config.json a run wrote) used as defaults; flags override
    it. "" = none."""

    env: str = "pendulum"
    """Environment name for hpcrl.envs.make_env ("pendulum", "cartpole_swingup", "gym:HalfCheetah-v5", ...);
    non-empty, no whitespace or control characters."""
    num_envs: int = 64
    """GLOBAL number of parallel envs (>= 1); must divide by the world size."""
    total_env_steps: int = 100_000
    """Transitions to collect over all ranks (>= 1; rounded up to a multiple of num_envs, i.e. whole vector
    steps)."""
    run_dir: str = "runs/fastsac"
    """Non-empty path without control characters."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir/checkpoints."""
    overwrite: bool = False
    """Delete the previous run in run_dir (its checkpoints, metrics, policies, ...) and start fresh there;
    without it (or --resume) a run dir holding a previous run is refused."""
    resume_missing: str = "error"
    """With --resume and no usable checkpoint in run_dir: "error" refuses (exit 2), "fresh" starts a new run
    and says so (what the sbatch scripts pass: a job requeued before its first checkpoint starts over)."""
    seed: int = 0
    """In [0, 2**31 - 1]."""
    seeds: str = ""
    """Comma-separated seeds, e.g. "0,1,2": run them one after another into RUN_DIR/seed_0, RUN_DIR/seed_1, ...
    (overrides --seed); "" = one run with --seed into RUN_DIR."""
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
    heartbeat_timeout_s: float = 15.0
    """A rank whose heartbeat stalls this long (frozen, swapped out, its host gone) is named and every other
    rank exits; in [1, timeout_s]: at least two heartbeats (every 0.5 s), and no longer than a collective's wait."""
    shared_memory: bool = True
    """Ranks on one host (--nproc, or srun tasks of one node) sum gradients, normaliser statistics and stop flags
    through a shared-memory segment instead of gloo's loopback sockets (CPU planes; NCCL has its own): a 256 KiB
    sum took 47 us instead of 2.2 ms on 2 cores (benchmarks/results/collectives_shm_quick.json). False keeps gloo."""

    batch_size: int = 8192
    """GLOBAL batch per update (>= 1); every rank samples batch_size / world_size."""
    buffer_size: int = 1024
    """Replay capacity per env (transitions); >= n_step."""
    n_step: int = 1
    """n-step returns (>= 1)."""
    gamma: float = 0.97
    """Discount, in (0, 1]."""
    learning_starts: int = 10
    """Vector steps (one step of all num_envs envs) before the first update (>= 0)."""
    random_steps: int = 0
    """Vector steps with uniformly random actions at the start (exploration warm-up; >= 0)."""
    obs_normalization: bool = True
    """Normalise observations by running mean/std (reduced over ranks every vector step)."""
    nonfinite: NonFiniteMode = "error"
    """A NaN/inf reward or observation from the env: "error" stops the run (exit 65) naming env, rank, vector
    step and the quantity; "skip" keeps going and replaces those envs' transitions of that step by harmless
    ones (reward 0, the observation it acted on, truncated), counted in nonfinite_dropped."""

    num_updates: int = 8
    """Critic (+alpha) updates per vector step (>= 1)."""
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
    """Learn the entropy temperature alpha towards the target entropy (else alpha stays alpha_init)."""
    target_entropy_ratio: float = 0.0
    """target entropy = -ratio * action_dim (any finite value)."""
    grad_average: GradAverageMode = "flat"
    """How gradients are all-reduced: "flat" (one fused buffer), "view" (per-parameter views), "ddp"."""
    overlap_grad_average: bool = False
    """Start the gradient all-reduce bucket by bucket during backward (post-accumulate-grad hooks, async,
    waited before the step); same numbers bitwise. Needs --grad-average flat|view; no effect under --compile
    (its gradients come out of one graph) or on one rank."""
    flat_params: bool = True
    """Keep each model's parameters and gradients in one flat buffer (one optimizer step, Polyak update and
    all-reduce per buffer); False = per-parameter tensors. --grad-average ddp always uses per-parameter."""
    batched_critic: bool = False
    """Evaluate the critic's Q-heads as one batched matmul per layer (same network, same checkpoint keys).
    Off by default: on a CPU it is 1.01x at the pendulum sizes and 0.87x at halfcheetah's (sac_ladder.json)."""
    bf16: bool = False
    """Alias of --amp bf16 (kept for old command lines and config files); ignored when --amp is not none."""
    amp: AmpMode = "none"
    """Mixed precision of the forward passes (parameters and optimiser state stay fp32): "none", "bf16"
    (autocast, no scaler: bf16 has fp32's range), "fp16" (autocast + GradScaler in holosoma's order:
    all-reduce of the scaled gradients, unscale, clip, step; a step with an inf/NaN gradient is skipped
    on every rank alike)."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm of the critic and of the actor to this after the all-reduce (so every
    rank clips alike); 0 = off (holosoma's default). critic_grad_norm/actor_grad_norm (pre-clip) are logged."""
    symmetry: bool = False
    """Symmetry augmentation (holosoma's use_symmetry; needs an env with mirror maps, e.g. cartpole_swingup):
    every sampled batch is doubled with its mirrored transitions, so each update sees 2 x batch_size rows
    globally (batch_size sampled, batch_size mirrored), as in holosoma."""
    compile: bool = False
    """torch.compile the whole update (losses, backward, optimizer steps, Polyak; CUDA graphs on a GPU),
    hpcrl/sac/compiled.py; needs flat parameters and --amp none|bf16."""
    compile_cache: str = ""
    """Where --compile on CPU stores the compiled update, so that later runs on this machine load it instead of
    compiling again (hpcrl/sac/graph_store.py); "" = beside inductor's cache (TORCHINDUCTOR_CACHE_DIR, else
    /tmp/torchinductor_$USER), "none" = compile in every run (Dynamo's guarded path, as on CUDA)."""

    actor_hidden: int = 512
    """Width of the first hidden layer (then /2, /4): >= 4."""
    critic_hidden: int = 768
    """Width of the first hidden layer (then /2, /4): >= 4."""
    num_q: int = 2
    """Critic heads (>= 1)."""
    cdq: bool = False
    """Clipped double Q: every head's target is the distribution of the target head with the lowest expected
    value (per sample) and the actor maximises the lowest head (FastTD3's CDQ, CleanRL's min of two Qs);
    False = holosoma (each head its own target, the actor the mean of the heads)."""
    num_atoms: int = 101
    """C51 atoms of each head's return distribution, >= 2."""
    v_min: float = -20.0
    """Support of the return distribution: finite, v_min < v_max."""
    v_max: float = 20.0
    """Finite, > v_min."""
    layer_norm: bool = True
    """LayerNorm after each hidden layer of actor and critic."""
    log_std_min: float = -5.0
    """The actor's log-std range: finite, log_std_min < log_std_max."""
    log_std_max: float = 0.0
    """Finite, > log_std_min."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before storage (keeps returns inside [v_min, v_max]); finite, not 0."""

    log_every: int = 10
    """Vector steps (one step of all num_envs envs) between metrics rows (>= 1)."""
    checkpoint_every: int = 500
    """Vector steps between checkpoints (a multiple of log_every); 0 = none but the final one (a checkpoint
    is always written at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in run_dir/checkpoints (>= 1)."""
    check_replicas_every: int = 1000
    """Critic updates between cross-rank parameter checksums (0 disables)."""
    eval_episodes: int = 0
    """Deterministic evaluation episodes per rank, run at the end (final eval_return) and by --eval-every
    (0 = none; --eval-every then uses 1)."""
    eval_every: int = 0
    """Vector steps between evaluations during training (a multiple of log_every; 0 = off): logged as rows
    with eval_return; the best one so far is saved as RUN_DIR/best/policy.pt."""
    wandb_project: str = ""
    """Also log the metrics rows to this Weights & Biases project (rank 0; pip install wandb); "" = off."""
    wandb_mode: WandbMode = "online"
    """W&B mode: "online", "offline" (files under WANDB_DIR or RUN_DIR/wandb; wandb sync later), "disabled"."""

    def check(self) -> None:
        """Every value against its documented range, before any rank starts: :class:`ConfigError` (a
        ValueError) with one line naming the flag, the bad value, the valid range and a value that works
        (world-size dependent checks, e.g. divisibility by the number of ranks, are
        :func:`hpcrl.sac.run.plan`'s)."""
        known = isinstance(self.preset, str) and self.preset in PRESETS
        c = Check(self, preset(self.preset) if known else None,
                  f"the {self.preset} preset's" if known and self.preset != "holosoma" else "the default")
        # Order matters: the first bad value is the one reported, and the tests pin which one that is.
        self._check_run(c)
        self._check_schedule(c)
        self._check_learner(c)
        self._check_networks(c)
        self._check_logging(c)
        self._check_sources(c)

    def _check_run(self, c: Check) -> None:
        """The env, sizes, run dir and the processes that run it."""
        c.text("env", spaces=False)
        c.integer("num_envs", 1, hint="parallel envs over all ranks")
        c.integer("total_env_steps", 1, hint="env transitions to collect")
        c.text("run_dir")
        c.boolean("resume")
        c.boolean("overwrite")
        if self.resume and self.overwrite:
            raise ConfigError("--resume --overwrite: --resume continues the run in --run-dir, --overwrite replaces "
                              "it; pass one of them")
        c.choice("resume_missing", {"error", "fresh"}.__contains__, "error, fresh")
        c.integer("seed", 0, MAX_SEED)
        c.choice("device", DEVICE.fullmatch, "auto, cpu, cuda or cuda:K")
        c.integer("nproc", 1, hint="local ranks to spawn; 1 = this process")
        c.integer("threads", 1, hint="torch threads per rank")
        c.real("timeout_s", 0.0, MAX_TIMEOUT_S, lo_open=True, hint="seconds")
        c.real("heartbeat_timeout_s", 1.0, hint="seconds; two heartbeats are 1 s")
        if not self.heartbeat_timeout_s <= self.timeout_s:
            c.fail("heartbeat_timeout_s", f"<= --timeout-s {self.timeout_s:g} (a frozen rank is named by its "
                   "heartbeat before a collective gives up)", "lower it or raise --timeout-s")

    def _check_schedule(self, c: Check) -> None:
        """Batch, replay and the steps before and between updates."""
        c.integer("batch_size", 1, hint="global batch per update")
        c.integer("n_step", 1, hint="n-step returns")
        c.integer("buffer_size", max(1, self.n_step),
                  hint=f"replay transitions per env; not below --n-step {self.n_step}",
                  fix=f"e.g. --buffer-size {max(self.n_step, SACConfig.buffer_size)}, or a smaller --n-step")
        c.real("gamma", 0.0, 1.0, lo_open=True, hint="discount")
        c.integer("learning_starts", 0, hint="vector steps before the first update")
        c.integer("random_steps", 0, hint="vector steps with random actions")
        c.boolean("obs_normalization")
        c.integer("num_updates", 1, hint="critic updates per vector step")
        c.integer("policy_frequency", 1, hint="critic updates per actor update")

    def _check_learner(self, c: Check) -> None:
        """Optimizers, entropy temperature, gradient averaging and precision."""
        c.real("tau", 0.0, 1.0, lo_open=True, hint="soft target update rate")
        for name in ("critic_lr", "actor_lr", "alpha_lr"):
            c.real(name, 0.0, lo_open=True, hint="learning rate")
        c.real("weight_decay", 0.0, hint="AdamW weight decay")
        c.real("alpha_init", 0.0, lo_open=True, hint="initial entropy temperature; its log is learned")
        c.boolean("autotune_alpha")
        c.real("target_entropy_ratio", hint="target entropy = -ratio * action_dim")
        c.choice("grad_average", get_args(GradAverageMode).__contains__, ", ".join(get_args(GradAverageMode)))
        c.boolean("flat_params")
        c.boolean("overlap_grad_average")
        c.boolean("shared_memory")
        if self.overlap_grad_average and (self.grad_average == "ddp" or (self.grad_average == "flat" and not self.flat_params)):
            c.fail("overlap_grad_average", "used with gradients in a flat buffer",
                   "use --flat-params (the default) or --grad-average view, or drop --overlap-grad-average")
        c.boolean("batched_critic")
        c.boolean("bf16")
        c.choice("amp", get_args(AmpMode).__contains__, ", ".join(get_args(AmpMode)))
        c.real("max_grad_norm", 0.0, hint="gradient-norm clip; 0 = off")
        c.boolean("symmetry")
        c.boolean("compile")
        if self.compile_cache:
            c.text("compile_cache")

    def _check_networks(self, c: Check) -> None:
        """Actor and critic shapes, the return support and the reward scale."""
        for name in ("actor_hidden", "critic_hidden"):
            c.integer(name, 4, hint="hidden widths are it, /2 and /4")
        c.integer("num_q", 1, hint="critic heads")
        c.boolean("cdq")
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

    def _check_logging(self, c: Check) -> None:
        """Metrics, checkpoints, replica checks, evaluation, and the preset / non-finite / W&B modes."""
        c.integer("log_every", 1, hint="vector steps between metrics rows")
        c.integer("checkpoint_every", 0, hint="vector steps between checkpoints; 0 = only at the end")
        c.integer("keep_checkpoints", 1, hint="checkpoints kept")
        c.integer("check_replicas_every", 0, hint="critic updates between checksums; 0 = never")
        c.integer("eval_episodes", 0, hint="evaluation episodes per rank; 0 = none")
        c.integer("eval_every", 0, hint="vector steps between evaluations; 0 = off")
        if self.eval_every and self.eval_every % self.log_every:
            c.fail("eval_every", f"a multiple of --log-every {self.log_every} (an eval row lands on a metrics row)",
                   f"e.g. --eval-every {max(1, round(self.eval_every / self.log_every)) * self.log_every}")
        c.choice("preset", PRESETS.__contains__, ", ".join(sorted(PRESETS)))
        c.choice("nonfinite", get_args(NonFiniteMode).__contains__, ", ".join(get_args(NonFiniteMode)))
        c.choice("wandb_mode", get_args(WandbMode).__contains__, ", ".join(get_args(WandbMode)))

    def _check_sources(self, c: Check) -> None:
        """Optional strings: --config, --wandb-project and --seeds, checked only when given."""
        if self.config != "":
            c.text("config")
        if self.wandb_project != "":
            c.text("wandb_project", spaces=False)
        if self.seeds != "":
            try:
                if not isinstance(self.seeds, str):
                    raise ValueError("not a string")
                parse_seeds(self.seeds)
            except ValueError as err:
                c.fail("seeds", f"comma-separated integers in [0, {MAX_SEED}] ({err})", "e.g. --seeds 0,1,2")


def preset(name: str, **overrides) -> SACConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(SACConfig(), preset=name, **{**PRESETS[name], **overrides})


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: distinct integers in [0, 2**31 - 1], in the order given."""
    seeds = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a non-negative integer")
        seed = int(part)
        if seed > MAX_SEED or seed in seeds:
            raise ValueError(f"{seed} is {'too large' if seed > MAX_SEED else 'repeated'}")
        seeds.append(seed)
    return seeds


def seed_runs(cfg: SACConfig) -> list[SACConfig]:
    """One config per run: ``cfg`` itself without --seeds, else one per seed into ``RUN_DIR/seed_<seed>``
    (``seeds`` cleared, so each run's config.json reruns exactly that seed)."""
    if not cfg.seeds:
        return [cfg]
    return [dataclasses.replace(cfg, seed=s, seeds="", run_dir=str(Path(cfg.run_dir) / f"seed_{s}"))
            for s in parse_seeds(cfg.seeds)]
