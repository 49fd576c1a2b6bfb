"""The contract between detached PPO's roles and a workload (vector-env PPO, token-level LM PPO).

Makers and trainers know nothing about the task; a workload knows nothing about processes. The
same three calls run the single-process synchronous loop (:mod:`hpcrl.ppo.sync`) and the detached
roles, so ``--lag 0`` with 1 maker : 1 trainer reproduces the synchronous run number for number.

Every hook the roles call is declared here, in :class:`Workload`, :class:`Collector` and
:class:`Learner`: the abstract ones a workload must write, the others with their defaults; what the
roles may ask beyond the required hooks, a workload says in one :class:`Capabilities` value, never by
the roles looking for attributes. Built-in workloads subclass them; a ``package.module:Class`` plugin
that does not is adapted once by :func:`hpcrl.ppo.workload_plugin.as_workload` (its own methods where
it has them, the defaults elsewhere).

Data: an experience batch is a ``dict[str, Tensor]`` with fixed keys, shapes and dtypes for a given
workload config (it travels as one packed buffer; padded fields a collector declares ragged travel as
their rows' spans, :meth:`Collector.ragged`). It must contain ``behaviour_logp`` (the maker's
log-probabilities of the taken actions) so the trainer can correct for staleness.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import nn

from hpcrl.core.config_check import ConfigError

from .losses import Advantage, ISLevel, ISMode, LossNorm, LRSchedule, adaptive_kl_coef, lr_at
from .ragged import Ragged

__all__ = ["AdamLearner", "Capabilities", "Collector", "Learner", "PPOConfig", "Workload", "check_rollout_correction",
           "check_variants"]


@dataclass
class PPOConfig:
    """Hyper-parameters shared by every workload's update."""

    epochs: int = 4
    minibatches: int = 4
    lr: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    value_clip_coef: float | None = 0.2
    """None disables value clipping."""
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    normalize_advantages: bool = True
    truncated_is: float | None = None
    """Cap of the truncated importance weight pi_current_at_start / pi_behaviour (None: off); with
    is_mode mask, the threshold C of the band the weight must stay in."""
    is_level: ISLevel = "token"
    """What one importance weight covers (needs truncated_is unless token): token = each token's own ratio,
    sequence = the product of a sequence's token ratios, geometric = their geometric mean per sequence; a
    sequence's weight applies to all its tokens."""
    is_mode: ISMode = "truncate"
    """truncate = cap each weight at truncated_is; mask = drop (weight 0) the tokens whose weight exceeds it
    (token level) or the sequences whose weight lies outside [1 / truncated_is, truncated_is]."""
    kl_coef: float = 0.05
    """Per-token KL penalty against the frozen initial model (LM workload); with ``kl_target`` its
    starting value."""
    advantage: Advantage = "grpo"
    """Group baseline of ``--hf.algo grpo``: grpo = (score - mean) / std, dr-grpo = score - mean (no std
    division), rloo = score - mean of the group's other samples (leave-one-out)."""
    loss_norm: LossNorm = "token"
    """How token losses are averaged over a minibatch: token = over all its valid tokens, sequence = each
    sequence's mean then over sequences (original GRPO), dr-grpo = tokens' sum / (sequences x max
    response tokens) (length-unbiased)."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al. 2019): the target KL to the reference per sequence (nats) the
    controller steers kl_coef towards after each update; None: kl_coef stays fixed."""
    kl_horizon: int = 10_000
    """Adaptive KL: the controller's horizon in sequences (a 20% KL error moves kl_coef by 20% x
    sequences / horizon per update)."""
    warmup_updates: int = 0
    """Updates of linear learning-rate warm-up (lr x (u + 1) / warmup); 0 = none."""
    lr_schedule: LRSchedule = "constant"
    """After warm-up: constant, or cosine from lr to min_lr_ratio x lr over decay_updates updates."""
    decay_updates: int | None = None
    """Updates the cosine takes from lr to its minimum (required with lr_schedule cosine)."""
    min_lr_ratio: float = 0.0
    """The cosine's final learning rate as a fraction of lr, in [0, 1]."""
    trim_padding: bool = False
    """hf: each training forward (minibatch or micro-batch) drops the token columns that are padding in
    all of its sequences (prompt left-padding, response tail past its longest response): the same
    numbers, less compute; one host read of the batch's lengths per update, one per forward on a GPU."""
    pack_sequences: bool = False
    """hf: each training forward packs its sequences' real tokens (prompt and response, no padding) into
    rows as wide as the longest of them, first fit by length; position ids restart and attention stays
    within each sequence (transformers' packed-sequence masks, checked once per learner); the same
    numbers to float rounding, computed on real tokens only. Instead of trim_padding."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_variants(self)


def check_variants(cfg: PPOConfig) -> None:
    """The loss variants' values and combinations, one ConfigError line naming the --ppo.* flag."""
    def bad(flag: str, value: Any, rule: str, fix: str) -> None:
        raise ConfigError(f"--ppo.{flag} {value}: must be {rule}; {fix}")

    if cfg.pack_sequences and cfg.trim_padding:
        bad("pack-sequences", True, "used without --ppo.trim-padding (packing already computes no padding)",
            "drop --ppo.trim-padding")

    finite = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if cfg.advantage not in get_args(Advantage):
        bad("advantage", cfg.advantage, "grpo, dr-grpo or rloo", "e.g. --ppo.advantage rloo")
    if cfg.loss_norm not in get_args(LossNorm):
        bad("loss-norm", cfg.loss_norm, "token, sequence or dr-grpo", "e.g. --ppo.loss-norm token (the default)")
    if cfg.kl_target is not None and not (finite(cfg.kl_target) and cfg.kl_target > 0):
        bad("kl-target", cfg.kl_target, "a finite number > 0 (nats per sequence)", "e.g. --ppo.kl-target 6, or unset")
    if not (integer(cfg.kl_horizon) and 1 <= cfg.kl_horizon <= 1 << 40):
        bad("kl-horizon", cfg.kl_horizon, "an integer >= 1 (sequences)", "e.g. --ppo.kl-horizon 10000")
    if not (integer(cfg.warmup_updates) and 0 <= cfg.warmup_updates <= 1 << 40):
        bad("warmup-updates", cfg.warmup_updates, "an integer >= 0", "e.g. --ppo.warmup-updates 10")
    if cfg.lr_schedule not in get_args(LRSchedule):
        bad("lr-schedule", cfg.lr_schedule, "constant or cosine", "e.g. --ppo.lr-schedule cosine")
    if cfg.decay_updates is not None and not (integer(cfg.decay_updates) and 1 <= cfg.decay_updates <= 1 << 40):
        bad("decay-updates", cfg.decay_updates, "an integer >= 1", "e.g. --ppo.decay-updates 1000")
    if cfg.lr_schedule == "cosine" and cfg.decay_updates is None:
        raise ConfigError("--ppo.lr-schedule cosine: needs --ppo.decay-updates N, the updates the cosine takes from "
                          "--ppo.lr to its minimum (e.g. the run's --total-steps)")
    if not (finite(cfg.min_lr_ratio) and 0 <= cfg.min_lr_ratio <= 1):
        bad("min-lr-ratio", cfg.min_lr_ratio, "in [0, 1]", "e.g. --ppo.min-lr-ratio 0.1")
    check_rollout_correction(cfg)


def check_rollout_correction(cfg: PPOConfig) -> None:
    """``is_level`` / ``is_mode`` and the ``truncated_is`` they need: C >= 1 to truncate (a cap below 1
    would cut on-policy weights of 1), C > 1 to mask (the band [1 / C, C] must hold 1)."""
    if cfg.is_level not in get_args(ISLevel):
        raise ConfigError(f"--ppo.is-level {cfg.is_level}: must be token, sequence or geometric; e.g. --ppo.is-level "
                          "sequence, or leave it unset (token)")
    if cfg.is_mode not in get_args(ISMode):
        raise ConfigError(f"--ppo.is-mode {cfg.is_mode}: must be truncate or mask; e.g. --ppo.is-mode mask, or leave "
                          "it unset (truncate)")
    cap = cfg.truncated_is
    if cap is None:
        if (cfg.is_level, cfg.is_mode) != ("token", "truncate"):
            flag, value = ("is-level", cfg.is_level) if cfg.is_level != "token" else ("is-mode", cfg.is_mode)
            raise ConfigError(f"--ppo.{flag} {value}: needs --ppo.truncated-is C (the weight's cap or band), e.g. "
                              f"--ppo.truncated-is 2; or drop --ppo.{flag}")
        return
    finite = isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap)
    if cfg.is_mode == "mask" and not (finite and cap > 1):
        raise ConfigError(f"--ppo.truncated-is {cap}: must be a finite number > 1 with --ppo.is-mode mask (it drops "
                          "weights above C, at the sequence levels outside [1/C, C]: 1 must stay in); e.g. "
                          "--ppo.truncated-is 2")
    if cfg.is_mode == "truncate" and not (finite and cap >= 1):
        raise ConfigError(f"--ppo.truncated-is {cap}: must be a finite number >= 1 (the cap of the importance "
                          f"weight; below 1 it cuts on-policy weights); e.g. --ppo.truncated-is 2, or unset (off)")


@dataclass(frozen=True)
class Capabilities:
    """What a workload does beyond the required hooks (:meth:`Workload.capabilities`): the roles read
    these flags and call the matching hooks, which every workload has (declared on :class:`Workload`)."""

    builds_on_meta: bool = False
    """Under ``--strategy fsdp`` the trainers build the model on ``meta`` (``build_model(seed, "meta")``),
    shard it, and :meth:`Workload.materialize` fills each trainer's shards: no trainer holds it whole."""
    saves_artifacts: bool = False
    """Trainer 0 exports after every checkpoint (:meth:`Workload.save_artifacts`, or
    :meth:`Workload.export_checkpoint` with ``exports_from_shards``); else no state is read back for it."""
    exports_from_shards: bool = False
    """:meth:`Workload.export_checkpoint` reads a checkpoint's DCP shards itself (streamed, nothing kept);
    else an export reads the state in full and hands it to :meth:`Workload.save_artifacts`."""


class Workload(ABC):
    """One task. ``model`` is the trainable actor(-critic) whose weights the trainers publish."""

    name: str = ""

    @abstractmethod
    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        """Identical on every rank for the same seed."""

    @abstractmethod
    def publish_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors a weight publish carries, in a fixed order (all parameters, or only trainable
        ones such as LoRA adapters). Makers receive into these same tensors of their model."""

    @abstractmethod
    def make_collector(self, rank_seed: int, device: torch.device) -> Collector:
        """Maker-side rollout state (envs, prompt stream)."""

    @abstractmethod
    def make_learner(self, model: nn.Module, cfg: PPOConfig, grad_average: Any) -> Learner:
        """Trainer-side optimiser state; ``grad_average`` averages gradients over the trainer plane
        (an :class:`hpcrl.comm.GradAverager` over ``model``'s trainable parameters, or the fsdp strategy's)."""

    def after_publish(self, model: nn.Module) -> None:
        """Maker side, after new publish tensors were written: rebuild derived weights (e.g. merge LoRA
        into a pristine base copy — never accumulate). Default: nothing to rebuild."""

    def default_config(self) -> PPOConfig:
        """The workload's PPO hyper-parameters (``--ppo.*`` flags override them)."""
        return PPOConfig()

    def build_maker_model(self, seed: int, device: torch.device) -> nn.Module:
        """What makers build instead of :meth:`build_model` (e.g. an RLHF actor without its critic);
        its :meth:`publish_tensors` must be the trainers'. Default: :meth:`build_model`."""
        return self.build_model(seed, device)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """The FSDP units for ``--strategy fsdp``: submodules innermost first, then the roots whose
        forward the learner calls. Default: refuse (the workload runs under ddp only)."""
        raise ConfigError(f"--strategy fsdp: workload {self.name!r} does not say which submodules to shard "
                          "(no shard_units method); use --strategy ddp")

    def rank_modules(self) -> tuple[str, ...]:
        """Modules every rank of this workload imports: loaded once by the launcher's forkserver
        (:func:`hpcrl.comm.spawn`'s ``preload``) instead of by each rank; importing them must start no
        thread (a fork inherits none). Default: the workload's module when it is hpcrl's own (a plugin's
        imports stay in its ranks unless it overrides this)."""
        module = type(self).__module__
        return (module,) if module.startswith("hpcrl.") else ()

    def capabilities(self) -> Capabilities:
        """What the roles may ask of this workload beyond the required hooks. Default: a workload that
        overrides :meth:`save_artifacts` saves artifacts, one that overrides :meth:`export_checkpoint`
        exports from shards; nothing else."""
        return Capabilities(saves_artifacts=type(self).save_artifacts is not Workload.save_artifacts,
                            exports_from_shards=type(self).export_checkpoint is not Workload.export_checkpoint)

    def materialize(self, model: nn.Module) -> None:
        """Under fsdp, after ``fully_shard`` and ``to_empty`` allocated this trainer's shards of a model
        built on ``meta`` (``capabilities().builds_on_meta``): fill them. Default: refuse."""
        raise ValueError(f"--strategy fsdp: workload {self.name!r} built its model on the meta device but has no "
                         "materialize(model) to fill the shards")

    def save_artifacts(self, model_state: dict[str, torch.Tensor], out_dir: str | os.PathLike | None = None) -> Any:
        """Trainer 0 after every checkpoint (``capabilities().saves_artifacts``), with the full model state
        (e.g. a save_pretrained export), into ``out_dir`` (None: the workload's own place). Default:
        nothing to save."""

    def export_checkpoint(self, dcp_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Any:
        """:meth:`save_artifacts` of the model state in the DCP checkpoint ``dcp_dir``, read by the
        workload itself (``capabilities().exports_from_shards``). Default: refuse (the caller reads the
        state and calls :meth:`save_artifacts`)."""
        raise NotImplementedError(f"workload {self.name!r} does not export from checkpoint shards")


class Collector(ABC):
    """Maker-side rollout state of one maker."""

    @abstractmethod
    def collect(self, model: nn.Module, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """One experience batch (fixed shapes) and rollout stats (e.g. ``episode_return_sum``,
        ``episodes``, ``env_steps``) as plain floats."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def assign(self, batch: int, seed: int) -> None:
        """Called by a maker before each ``collect`` with the run's batch number (from the trainer's
        credit: ``credit_id x trainers + trainer``, unique in the run and continued across a resume)
        and the run's seed; a collector over a dataset (prompts) serves a fixed slice for each batch,
        so makers split the data and a resumed run continues with the next item. Default: ignore it."""

    def load_weights(self, model: nn.Module, version: int) -> None:
        """Called by a maker at each swap, after the published tensors of ``version`` were written into
        ``model`` and the workload's ``after_publish`` ran: a collector that generates through an engine
        of its own hands it the tensors here. Default: nothing (it generates with ``model`` itself)."""

    def close(self) -> None:
        """Called once when the maker ends: free what the collector holds (an engine). Default: nothing."""

    def ragged(self) -> tuple[Ragged, ...]:
        """The fields of its batches padded to a fixed width, declared with the span that holds each row's
        real values (:class:`~hpcrl.ppo.ragged.Ragged`): they travel as those spans only and arrive padded
        as they left. Read once, with the first batch. Default: none (every field travels whole)."""
        return ()


class Learner(ABC):
    """Trainer-side optimiser state of one trainer."""

    optimizer: torch.optim.Optimizer | None = None
    """The optimizer over the trainable parameters, its state_dict kept under ``"optimizer"`` in
    :meth:`state_dict`: ``--strategy fsdp`` cuts each trainer's shard of its moments out of a
    checkpoint through it. None: the learner runs under ddp only."""

    @abstractmethod
    def update(self, batches: list[dict[str, torch.Tensor]], generator: torch.Generator) -> dict[str, float]:
        """PPO epochs/minibatches on the concatenated batches (advantages computed here, with the
        current critic); returns scalar stats (policy_loss, value_loss, entropy, approx_kl, clip_frac, ...)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdamLearner(Learner):
    """What the token-level learners (``lm``, ``hf``) share: Adam over the trainable parameters, an
    update counter (the learning-rate schedule's position) and the KL coefficient (adaptive with
    ``cfg.kl_target``), which is all they checkpoint (the model is saved by the trainer)."""

    def __init__(self, model: nn.Module, cfg: PPOConfig, grad_average: Any) -> None:
        self.model, self.cfg, self.grad_average = model, cfg, grad_average
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, eps=1e-5)
        self.updates = 0
        self.kl_coef = float(cfg.kl_coef)

    def start_update(self) -> float:
        """The schedule's learning rate for this update, set on the optimizer and returned."""
        cfg = self.cfg
        lr = lr_at(self.updates, cfg.lr, cfg.lr_schedule, cfg.warmup_updates, cfg.decay_updates, cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def trainers(self) -> int:
        """How many trainers average this learner's gradients (1 without a trainer plane)."""
        plane = getattr(self.grad_average, "plane", None)
        return plane.size if plane is not None and plane.active else 1

    def kl_measure(self, kl_per_sequence: torch.Tensor) -> torch.Tensor:
        """The batch's KL per sequence averaged over the trainers (a device all-reduce on the trainer
        plane, in lockstep like the gradients'): every trainer's controller then moves the same way,
        so the coefficient stays one number across trainers and resumes as one."""
        t = kl_per_sequence.detach().to(torch.float64).clone()
        plane = getattr(self.grad_average, "plane", None)
        if plane is not None and plane.active:
            import torch.distributed as dist

            t = t.to(plane.device)
            dist.all_reduce(t, group=plane.group)
            t = t / plane.size
        return t

    def finish_update(self, kl_per_sequence: float, sequences: int) -> float:
        """Count the update and move the KL coefficient (``cfg.kl_target``) by the batch's measured KL
        to the reference per sequence (:meth:`kl_measure`) over ``sequences`` (all trainers'); returns
        the coefficient this update used."""
        used = self.kl_coef
        self.updates += 1
        if self.cfg.kl_target is not None and math.isfinite(kl_per_sequence):
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl_per_sequence, self.cfg.kl_target, self.cfg.kl_horizon,
                                            sequences)
        return used

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "updates": self.updates, "kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
        self.kl_coef = float(state.get("kl_coef", self.cfg.kl_coef))  # checkpoints from before adaptive KL
