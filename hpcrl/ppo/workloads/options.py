"""Typed options of the built-in workloads and of the PPO update: nested groups of ``python -m hpcrl.ppo``
(``--env.num-envs 16``, ``--lm.lora-rank 4``, ``--ppo.lr 1e-3``), each field with its valid range.

Each group's :meth:`check` raises :class:`~hpcrl.core.config_check.ConfigError` with one line naming the
flag (``--ppo.lr``), the bad value, the range and a value that works; :meth:`kwargs` is what the
workload constructor (or :class:`~hpcrl.ppo.workload.PPOConfig`) receives. A field left at ``None``
keeps the workload's own default (cartpole and swing-up differ in their sizes and their PPO settings).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from hpcrl.core.config_check import Check, ConfigError, show

__all__ = ["GroupCheck", "LMOptions", "PPOOptions", "VectorEnvOptions"]


class GroupCheck(Check):
    """:class:`Check` for a nested option group: flags read ``--GROUP.NAME`` (as tyro spells them)."""

    def __init__(self, cfg: Any, group: str) -> None:
        super().__init__(cfg)
        self.group = group

    def flag(self, name: str) -> str:
        return f"--{self.group}.{name.replace('_', '-')}"

    def fail(self, name: str, rule: str, fix: str | None = None) -> None:
        default = getattr(self.defaults, name)
        if fix is None:
            fix = (f"e.g. {self.flag(name)} {show(default)} (the default)" if default is not None
                   else f"leave {self.flag(name)} unset for the workload's default")
        raise ConfigError(f"{self.flag(name)} {show(getattr(self.cfg, name))}: must be {rule}; {fix}")

    def optional_integer(self, name: str, lo: int, hi: int, hint: str, example: int) -> None:
        if getattr(self.cfg, name) is not None:
            self.integer(name, lo, hi, hint=hint, fix=f"e.g. {self.flag(name)} {example}, or leave it unset")

    def optional_real(self, name: str, lo: float, hi: float | None = None, *, lo_open: bool = False,
                      hint: str = "", example: float, off: bool = False) -> None:
        """``off``: ``inf`` is allowed too and means "disabled" (see :meth:`PPOOptions.overrides`)."""
        value = getattr(self.cfg, name)
        if value is None or (off and value == math.inf):
            return
        self.real(name, lo, hi, lo_open=lo_open, hint=hint,
                  fix=f"e.g. {self.flag(name)} {show(example)}" + (", or inf for off" if off else "")
                  + ", or leave it unset")


MAX_ENVS = 65_536
"""Largest --env.num-envs: envs per maker, all stepped in one tensor; more is a memory error, not a rollout."""
MAX_ROLLOUT = 100_000
MAX_HIDDEN = 8192
MAX_SEQ = 4096


@dataclass
class VectorEnvOptions:
    """Options of the vector-env workloads (--workload cartpole, swingup, continuous, pendulum)."""

    num_envs: int | None = None
    """Environments per maker (default: 8 for cartpole, 16 for swingup/continuous/pendulum); in [1, 65536]."""
    rollout_len: int | None = None
    """Steps per environment in one experience batch (default: 32 for cartpole, 64 for the others); in
    [1, 100000]."""
    hidden: int = 64
    """Width of the two hidden layers of the actor and of the critic MLP; in [1, 8192]."""
    init_log_std: float = 0.0
    """Initial log standard deviation of the Gaussian policy, in action units (continuous workloads only);
    in [-5, 2]."""

    def check(self) -> None:
        c = GroupCheck(self, "env")
        c.optional_integer("num_envs", 1, MAX_ENVS, "environments per maker", 16)
        c.optional_integer("rollout_len", 1, MAX_ROLLOUT, "steps per environment per batch", 64)
        c.integer("hidden", 1, MAX_HIDDEN, hint="MLP width")
        c.real("init_log_std", -5.0, 2.0, hint="log std in action units")

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class LMOptions:
    """Options of the token-level LM workload (--workload lm); see hpcrl.ppo.workloads.lm."""

    batch_size: int = 32
    """Sequences (prompt + response) per experience batch; in [1, 65536]."""
    lora_rank: int = 0
    """LoRA adapter rank on every linear layer of actor and critic (0: full fine-tuning, every weight trains
    and is published); in [0, d_model]."""
    lora_alpha: float | None = None
    """LoRA scale numerator (effective scale alpha / rank; default: alpha = rank, scale 1); > 0."""
    vocab: int = 16
    """Vocabulary size of the tiny LM; in [2, 65536]."""
    prompt_len: int = 6
    """Prompt tokens; prompt_len + gen_len in [2, 4096]."""
    gen_len: int = 6
    """Generated (response) tokens; >= 1."""
    d_model: int = 32
    """Transformer width; a multiple of n_heads, in [1, 8192]."""
    n_layers: int = 2
    """Transformer blocks; in [1, 64]."""
    n_heads: int = 2
    """Attention heads; in [1, d_model] and dividing d_model."""
    pretrain_steps: int = 200
    """In-process pretraining steps on the counting corpus before PPO (0: an untrained LM); in [0, 1000000]."""
    pretrain_batch: int = 32
    """Sequences per pretraining step; in [1, 65536]."""
    pretrain_lr: float = 3e-3
    """Pretraining learning rate; in (0, 1]."""
    target_token: int = 0
    """The token the reward counts (score = its share of the response); in [0, vocab)."""
    noise: float = 0.1
    """Share of random tokens in the pretraining corpus; in [0, 1]."""
    steps: tuple[int, ...] = (1, 2, 3)
    """Counting steps d of the corpus (x[t+1] = x[t] + d mod vocab); one or more integers in [0, vocab)."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL(behaviour || initial) estimator of the reward's penalty: k1 = log ratio, k3 = Schulman's
    non-negative estimator."""

    def check(self) -> None:
        c = GroupCheck(self, "lm")
        c.integer("batch_size", 1, MAX_ENVS, hint="sequences per batch")
        c.integer("vocab", 2, MAX_ENVS, hint="tokens")
        c.integer("d_model", 1, MAX_HIDDEN, hint="transformer width")
        c.integer("n_layers", 1, 64, hint="blocks")
        c.integer("n_heads", 1, self.d_model, hint=f"at most --lm.d-model {self.d_model}")
        if self.d_model % self.n_heads:
            c.fail("n_heads", f"a divisor of --lm.d-model {self.d_model}", "e.g. --lm.n-heads 2 with --lm.d-model 32")
        c.integer("lora_rank", 0, self.d_model, hint=f"0 = off; at most --lm.d-model {self.d_model}")
        if self.lora_alpha is not None:
            c.real("lora_alpha", 0.0, lo_open=True, fix="e.g. --lm.lora-alpha 8, or leave it unset (alpha = rank)")
        c.integer("prompt_len", 1, MAX_SEQ - 1, hint="prompt tokens")
        c.integer("gen_len", 1, MAX_SEQ - self.prompt_len, hint=f"prompt + response <= {MAX_SEQ} tokens")
        c.integer("pretrain_steps", 0, 1_000_000, hint="0 = no pretraining")
        c.integer("pretrain_batch", 1, MAX_ENVS, hint="sequences per pretraining step")
        c.real("pretrain_lr", 0.0, 1.0, lo_open=True)
        c.integer("target_token", 0, self.vocab - 1, hint=f"a token of --lm.vocab {self.vocab}")
        c.real("noise", 0.0, 1.0, hint="share of random tokens")
        if (not isinstance(self.steps, tuple) or not self.steps
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < self.vocab for d in self.steps)):
            c.fail("steps", f"one or more integers in [0, {self.vocab})", "e.g. --lm.steps 1 2 3 (the default)")
        c.choice("kl_estimator", lambda v: v in ("k1", "k3"), "k1, k3")

    def kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PPOOptions:
    """Overrides of the workload's PPO hyper-parameters (unset: the workload's own, e.g. cartpole's SB3-zoo
    settings; see hpcrl.ppo.workload.PPOConfig)."""

    epochs: int | None = None
    """Passes over each step's experience; in [1, 1000]."""
    minibatches: int | None = None
    """Minibatches per pass; in [1, 65536]."""
    lr: float | None = None
    """Adam learning rate; in (0, 1]."""
    gamma: float | None = None
    """Discount factor; in [0, 1]."""
    gae_lambda: float | None = None
    """GAE lambda; in [0, 1]."""
    clip_coef: float | None = None
    """PPO ratio clip epsilon; in (0, 10]."""
    value_clip_coef: float | None = None
    """Value-function clip range around the old values; in (0, 1000], or inf for no value clipping."""
    ent_coef: float | None = None
    """Entropy bonus coefficient; in [0, 10]."""
    vf_coef: float | None = None
    """Value loss coefficient; in [0, 100]."""
    max_grad_norm: float | None = None
    """Gradient norm clip; in (0, 1000]."""
    normalize_advantages: bool | None = None
    """Whiten advantages per minibatch (True/False)."""
    truncated_is: float | None = None
    """Cap c of the truncated importance weight pi_current / pi_behaviour for stale experience (off by
    default); in [1, 1000], or inf for off."""
    is_level: Literal["token", "sequence", "geometric"] | None = None
    """What --ppo.truncated-is C weighs (token workloads): token (default) each token's ratio; sequence one
    weight per sequence, the product of its token ratios; geometric the geometric mean of its token ratios."""
    is_mode: Literal["truncate", "mask"] | None = None
    """truncate (default): weights above C are capped at C; mask: tokens above C (token level), or sequences
    whose weight lies outside [1/C, C], drop out of the loss."""
    kl_coef: float | None = None
    """Per-token KL penalty against the frozen initial model (--workload lm); in [0, 100]."""
    anneal_updates: int | None = None
    """Vector-env workloads: lr and clip decay linearly to 0 over this many updates (cartpole: 100k env
    steps' worth; 0 = constant); in [0, 10000000]."""
    adam_eps: float | None = None
    """Vector-env workloads: Adam epsilon (default 1e-5); in (0, 1]."""
    advantage: Literal["grpo", "dr-grpo", "rloo"] | None = None
    """--hf.algo grpo's group baseline: grpo = (score - mean) / std, dr-grpo = score - mean, rloo = score - mean
    of the group's other samples (default grpo)."""
    loss_norm: Literal["token", "sequence", "dr-grpo"] | None = None
    """Token losses over a minibatch: token = mean over its valid tokens (default), sequence = per-sequence mean
    then over sequences, dr-grpo = sum / (sequences x max response tokens), length-unbiased."""
    kl_target: float | None = None
    """Adaptive KL controller (Ziegler et al. 2019): target KL to the reference per sequence in nats (e.g. 6);
    unset: --ppo.kl-coef stays fixed. Token workloads (hf, lm)."""
    kl_horizon: int | None = None
    """Adaptive KL horizon in sequences (default 10000)."""
    warmup_updates: int | None = None
    """Updates of linear learning-rate warm-up (default 0)."""
    lr_schedule: Literal["constant", "cosine"] | None = None
    """After warm-up: constant (default) or cosine to --ppo.min-lr-ratio x lr over --ppo.decay-updates."""
    decay_updates: int | None = None
    """Updates the cosine takes from lr to its minimum (e.g. --total-steps); required with cosine."""
    min_lr_ratio: float | None = None
    """The cosine's final lr as a fraction of --ppo.lr (default 0); in [0, 1]."""
    trim_padding: bool | None = None
    """--workload hf: each training forward skips the token columns that are padding in all its sequences
    (same numbers, less compute; with --hf.micro-batch-size, pieces of like lengths)."""

    pack_sequences: bool | None = None
    """--workload hf: each training forward packs its sequences' real tokens into rows, no padding (position
    ids and attention per sequence; same numbers to float rounding). Instead of --ppo.trim-padding."""

    def check(self) -> None:
        c = GroupCheck(self, "ppo")
        c.optional_integer("epochs", 1, 1000, "passes per step", 4)
        c.optional_integer("minibatches", 1, MAX_ENVS, "minibatches per pass", 4)
        c.optional_real("lr", 0.0, 1.0, lo_open=True, example=1e-3)
        c.optional_real("gamma", 0.0, 1.0, example=0.99)
        c.optional_real("gae_lambda", 0.0, 1.0, example=0.95)
        c.optional_real("clip_coef", 0.0, 10.0, lo_open=True, example=0.2)
        c.optional_real("value_clip_coef", 0.0, 1000.0, lo_open=True, example=0.2, off=True)
        c.optional_real("ent_coef", 0.0, 10.0, example=0.01)
        c.optional_real("vf_coef", 0.0, 100.0, example=0.5)
        c.optional_real("max_grad_norm", 0.0, 1000.0, lo_open=True, example=0.5)
        if self.normalize_advantages is not None and not isinstance(self.normalize_advantages, bool):
            c.fail("normalize_advantages", "True or False", "e.g. --ppo.normalize-advantages False, or leave it unset")
        c.optional_real("truncated_is", 1.0, 1000.0, example=2.0, off=True)
        c.optional_real("kl_coef", 0.0, 100.0, example=0.02)
        c.optional_integer("anneal_updates", 0, 10_000_000, "0 = no annealing", 0)
        c.optional_real("adam_eps", 0.0, 1.0, lo_open=True, example=1e-5)
        c.optional_real("kl_target", 0.0, 1e6, lo_open=True, example=6.0)
        c.optional_integer("kl_horizon", 1, 1 << 40, "sequences", 10_000)
        c.optional_integer("warmup_updates", 0, 1 << 40, "updates", 10)
        c.optional_integer("decay_updates", 1, 1 << 40, "updates", 1000)
        c.optional_real("min_lr_ratio", 0.0, 1.0, example=0.1)
        if self.trim_padding is not None and not isinstance(self.trim_padding, bool):
            c.fail("trim_padding", "True or False", "e.g. --ppo.trim-padding True, or leave it unset")
        if self.pack_sequences is not None and not isinstance(self.pack_sequences, bool):
            c.fail("pack_sequences", "True or False", "e.g. --ppo.pack-sequences True, or leave it unset")
        # the combinations (cosine without --ppo.decay-updates, ...): PPOConfig's check_variants

    def overrides(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(PPOConfig fields, PPOConfig.extra entries) the user set; ``inf`` -> None (off) for the two caps."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        for name in ("value_clip_coef", "truncated_is"):
            if fields.get(name) == math.inf:
                fields[name] = None
        extra = {k: fields.pop(k) for k in ("anneal_updates", "adam_eps") if k in fields}
        return fields, extra
