"""Detached PPO configuration: one typed dataclass; every field is a command-line flag (tyro).

The workload's options and the PPO hyper-parameters are nested groups (``--env.num-envs 16``,
``--lm.lora-rank 4``, ``--ppo.truncated-is 2``: :mod:`hpcrl.ppo.workloads.options`). A
``package.module:Class`` workload takes the flags hpcrl.ppo does not know, parsed against its
constructor (:func:`parse_args`, :attr:`DetachedConfig.plugin_args`)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from hpcrl.run.cli import flag_value, spell_bools, tyro_call
from hpcrl.core.config_check import DEVICE, MAX_SEED, MAX_TIMEOUT_S, Check, ConfigError, show
from hpcrl.core.conventions import DEFAULT_MAKERS, DEFAULT_TRAINERS

from .plugins import plugin_class
from .workloads.hf_options import HFGroupOptions
from .workloads.options import LMOptions, PPOOptions, VectorEnvOptions

MAX_LAG = 64
"""Largest --lag: every version of staleness keeps batches_per_step more experience batches in flight per
trainer (and their weights' versions alive); beyond this it is a memory leak, not an overlap."""
MAX_CREDITS = 1024
"""Largest (lag + 1) x batches_per_step: experience batches in flight per trainer."""
MIN_BUCKET_MB = 1e-4
"""Smallest --bucket-mb (about 100 bytes): below it a publish becomes one broadcast per few values (0 hung)."""


VECTOR_WORKLOADS = ("cartpole", "swingup", "continuous", "pendulum")
"""Built-in workloads that take the --env.* options (hpcrl.ppo.workloads registry)."""
LM_WORKLOADS = ("lm",)
HF_WORKLOADS = ("hf",)
"""Built-in workloads that take the --lm.* options."""


def is_plugin(workload: str) -> bool:
    """``package.module:Class``: a user's workload, whose own flags are :attr:`DetachedConfig.plugin_args`."""
    return ":" in workload


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
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the trainers hold the model: "ddp" (a whole copy each, gradients all-reduced) or "fsdp" (FSDP2
    fully_shard: parameters, gradients and Adam state split over the trainers, gathered layer by layer;
    --workload hf). Checkpoints are the same file under both: a run may change strategy between jobs."""
    offload: bool = False
    """With --strategy fsdp: keep the trainers' parameter shards, gradients and optimizer state in host
    memory (the optimizer steps on the CPU; FSDP2 CPUOffloadPolicy). For models that do not fit on the GPUs."""
    trainer_dtype: Literal["fp32", "bf16"] = "fp32"
    """Trainers' compute precision: "fp32", or "bf16" (with --strategy fsdp: bf16 parameters in forward and
    backward, fp32 gradient reduction, fp32 master weights and Adam). Published weights stay fp32."""
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
    """Continue the run in --run-dir from its newest checkpoint (--resume-missing says what happens when there is none)."""
    overwrite: bool = False
    """Delete the previous run in --run-dir (its checkpoints, metrics, ...) and start fresh there; without it
    (or --resume) a run dir holding a previous run is refused."""
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
    env: VectorEnvOptions = field(default_factory=VectorEnvOptions)
    """Options of the vector-env workloads (--workload cartpole, swingup, continuous, pendulum)."""
    lm: LMOptions = field(default_factory=LMOptions)
    """Options of the token-level LM workload (--workload lm)."""
    hf: HFGroupOptions = field(default_factory=HFGroupOptions)
    """Options of the Hugging Face RLHF workload (--workload hf): models by path or hub id, prompts,
    reward model or function, generation, PPO/GRPO, LoRA, maker precision."""
    ppo: PPOOptions = field(default_factory=PPOOptions)
    """PPO hyper-parameters (unset: the workload's own)."""
    plugin_args: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """A ``package.module:Class`` workload's own flags, as on the command line (``--rollout-s 0.05``):
    the flags hpcrl.ppo does not know, parsed against the class's typed constructor (tyro), which is
    the plugin's options. Built-in workloads take none."""

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
        if self.strategy not in ("ddp", "fsdp"):
            c.fail("strategy", "one of ddp, fsdp")
        c.boolean("offload")
        if self.trainer_dtype not in ("fp32", "bf16"):
            c.fail("trainer_dtype", "one of fp32, bf16")
        if self.strategy != "fsdp":
            if self.offload:
                raise ConfigError("--offload: offloads FSDP shards to host memory; e.g. add --strategy fsdp, or drop it")
            if self.trainer_dtype != "fp32":
                raise ConfigError(f"--trainer-dtype {self.trainer_dtype}: mixed precision is FSDP's; e.g. add "
                                  "--strategy fsdp, or drop it (fp32)")
        elif self.workload not in HF_WORKLOADS and not is_plugin(self.workload):
            raise ConfigError(f"--strategy fsdp: shards a transformer layer by layer (--workload hf, or a "
                              f"package.module:Class workload with shard_units); drop it: --workload {self.workload} "
                              "trains with --strategy ddp")
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
        _check_run_dir(c, self.run_dir)
        c.boolean("resume")
        c.boolean("overwrite")
        if self.resume and self.overwrite:
            raise ConfigError("--resume --overwrite: --resume continues the run in --run-dir, --overwrite replaces "
                              "it; pass one of them")
        if self.resume_missing not in ("error", "fresh"):
            c.fail("resume_missing", "one of error, fresh")
        c.real("timeout_s", 0.0, MAX_TIMEOUT_S, lo_open=True, hint="seconds")
        c.real("heartbeat_timeout_s", 1.0, hint="seconds; two heartbeats are 1 s")
        if not self.heartbeat_timeout_s <= self.timeout_s:
            c.fail("heartbeat_timeout_s", f"<= --timeout-s {show(self.timeout_s)} (a dead peer is named by its "
                   "heartbeat before a wait gives up)", "lower it or raise --timeout-s")
        c.integer("threads", 1, hint="torch threads per rank")
        c.integer("checkpoint_every", 0, hint="PPO updates between checkpoints; 0 = only at the end")
        self._check_options(c)

    def _check_options(self, c: Check) -> None:
        """Each option group's ranges, and that the groups given are the workload's own."""
        for name, kind in (("env", VectorEnvOptions), ("lm", LMOptions), ("hf", HFGroupOptions),
                           ("ppo", PPOOptions)):
            if not isinstance(getattr(self, name), kind):
                c.fail(name, f"a {kind.__name__}", f"set its fields as --{name}.FIELD VALUE (see --help)")
            if name == "hf" and self.workload not in HF_WORKLOADS:
                self.hf.check_ranges()  # check() also requires --hf.model, --hf.prompts and a reward
            else:
                getattr(self, name).check()
        if not isinstance(self.plugin_args, tuple) or not all(isinstance(a, str) for a in self.plugin_args):
            c.fail("plugin_args", "a tuple of command-line strings", "e.g. ('--rollout-s', '0.05')")
        plugin = is_plugin(self.workload)
        for name, family in (("env", VECTOR_WORKLOADS), ("lm", LM_WORKLOADS), ("hf", HF_WORKLOADS)):
            if getattr(self, name) != type(getattr(self, name))() and self.workload not in family:
                changed, value = next((f, v) for f, v in vars(getattr(self, name)).items()
                                      if v != getattr(type(getattr(self, name))(), f))
                raise ConfigError(f"--{name}.{changed.replace('_', '-')} {show(value)}: applies to --workload "
                                  f"{' / '.join(family)}, not --workload {self.workload}; drop it, or pass "
                                  f"--workload {family[0]}"
                                  + ("; a plugin workload takes its own flags (its constructor's)" if plugin else ""))
        self._check_variants()
        if self.plugin_args and not plugin:
            raise ConfigError(f"unrecognized option(s) {' '.join(self.plugin_args)} for --workload {self.workload}"
                              f"{_perhaps(self.plugin_args)}: "
                              "only a package.module:Class workload takes flags of its own; see python -m hpcrl.ppo "
                              "--help for the --env.*, --lm.*, --hf.* and --ppo.* options")

    def _check_variants(self) -> None:
        """The --ppo.* loss variants a workload's learner would refuse after its model is built: refused
        here, before any rank starts (the learners keep their own check for workloads built in code)."""
        ppo, workload = self.ppo, self.workload
        if workload in VECTOR_WORKLOADS:
            for flag, given in (("advantage", ppo.advantage), ("kl-target", ppo.kl_target),
                                ("is-level", None if ppo.is_level in (None, "token") else ppo.is_level)):
                if given is not None:
                    raise ConfigError(f"--ppo.{flag} {given}: applies to the token workloads (--workload hf / "
                                      f"lm), not a vector env (GAE advantages, no reference model, no sequences); "
                                      "drop it")
            if ppo.anneal_updates and (ppo.lr_schedule not in (None, "constant") or ppo.warmup_updates):
                raise ConfigError("--ppo.anneal-updates with --ppo.lr-schedule / --ppo.warmup-updates: two "
                                  "learning-rate schedules; keep one, e.g. --ppo.anneal-updates 0 for warm-up / cosine")
        elif workload in LM_WORKLOADS and ppo.advantage not in (None, "grpo"):
            raise ConfigError(f"--ppo.advantage {ppo.advantage}: a group baseline needs groups of samples per prompt "
                              "(--workload hf --hf.algo grpo); --workload lm uses GAE with its critic; drop it")
        elif workload in HF_WORKLOADS and ppo.advantage not in (None, "grpo") and self.hf.algo != "grpo":
            raise ConfigError(f"--ppo.advantage {ppo.advantage}: a group baseline needs --hf.algo grpo (samples per "
                              "prompt); drop it, or pass --hf.algo grpo")

    def bucket_numel(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per weight bucket (``bucket_mb``)."""
        return max(1, int(self.bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())

    @property
    def stale_cap(self) -> int:
        return self.lag if self.max_lag is None else self.max_lag


def _known_flags() -> list[str]:
    """Every flag of :class:`DetachedConfig`, its option groups' included (``--env.num-envs``)."""
    flags = []
    for f in fields(DetachedConfig):
        kind = f.default_factory if f.default_factory is not MISSING else None  # the option groups
        inner = [f"{f.name}.{g.name}" for g in fields(kind)] if is_dataclass(kind) else [f.name]
        flags += ["--" + name.replace("_", "-") for name in inner]
    return flags


def _perhaps(args: tuple[str, ...]) -> str:
    """" (perhaps you meant --total-steps)" for unknown flags close to known ones, else ""."""
    known = _known_flags()
    close = [m for a in args if a.startswith("--") for m in get_close_matches(a.split("=")[0], known, 1, 0.8)]
    return f" (perhaps you meant {' or '.join(dict.fromkeys(close))})" if close else ""


def _check_run_dir(c: Check, run_dir: str) -> None:
    """The run dir is a directory, or can become one: no existing file at it or at a parent (a rank
    would only find out creating it, as a FileExistsError)."""
    path = Path(run_dir)
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                where = "" if at == path else f" (its parent {str(at)!r} is a file)"
                c.fail("run_dir", f"a directory or a path to create, not an existing file{where}",
                       "pass another --run-dir, or move the file away")
            return


def parse_args(argv: list[str], prog: str = "python -m hpcrl.ppo") -> DetachedConfig:
    """The command line as a :class:`DetachedConfig`: hpcrl.ppo's flags (tyro), and for a
    ``package.module:Class`` workload the flags left over as its :attr:`~DetachedConfig.plugin_args`.
    A flag tyro cannot parse is a :class:`ConfigError` of one line (tyro's own message, without its
    box); ``--help`` prints and exits 0 as usual (with the plugin's own options after hpcrl.ppo's)."""
    workload = flag_value(argv, "--workload")
    if workload is not None and is_plugin(workload) and any(a in ("-h", "--help") for a in argv):
        _plugin_help(workload, prog)
    argv = spell_bools(DetachedConfig, argv)  # every bool flag: --x, --no-x, --x True / False
    cfg, rest = tyro_call(lambda: tyro.cli(DetachedConfig, args=argv, prog=prog, return_unknown_args=True,
                                           description=DESCRIPTION), prog)
    if rest:
        cfg.plugin_args = tuple(rest)  # check() refuses them for a built-in workload, naming them
    return cfg


DESCRIPTION = ("Detached PPO: experience makers and PPO trainers as separate process groups. Workload options: "
               "--env.* (cartpole, swingup, continuous, pendulum), --lm.* (lm), --hf.* (hf: Hugging Face models); PPO "
               "hyper-parameters: --ppo.* "
               "(unset: the workload's own). A package.module:Class workload takes its own flags, parsed against "
               "its constructor's typed arguments (python -m hpcrl.ppo --workload pkg.mod:Cls --help lists them).")


def _plugin_help(workload: str, prog: str) -> None:
    """Print the plugin's own options (from its constructor) before hpcrl.ppo's help."""
    try:
        cls = plugin_class(workload)
    except ConfigError as err:
        print(f"({err})")
        return
    try:
        tyro.cli(cls, args=["--help"], prog=f"{prog} --workload {workload} [hpcrl.ppo flags]",
                 description=f"Options of the plugin workload {workload} (its constructor's arguments):")
    except SystemExit:
        pass
    print()
