"""The contract between detached PPO's roles and a workload (vector-env PPO, token-level LM PPO).

Makers and trainers know nothing about the task; a workload knows nothing about processes. The
same three calls run the single-process synchronous loop (:mod:`hpcrl.ppo.sync`) and the detached
roles, so ``--lag 0`` with 1 maker : 1 trainer reproduces the synchronous run number for number.

Data: an experience batch is a ``dict[str, Tensor]`` with fixed keys, shapes and dtypes for a given
workload config (it travels as one packed buffer). It must contain ``behaviour_logp`` (the maker's
log-probabilities of the taken actions) so the trainer can correct for staleness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


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
    """Cap of the truncated importance weight pi_current_at_start / pi_behaviour (None: off)."""
    kl_coef: float = 0.05
    """Per-token KL penalty against the frozen initial model (LM workload)."""
    extra: dict[str, Any] = field(default_factory=dict)


class Workload(Protocol):
    """One task. ``model`` is the trainable actor(-critic) whose weights the trainers publish."""

    name: str

    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        """Identical on every rank for the same seed."""

    def sync_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors a weight publish carries, in a fixed order (all parameters, or only trainable
        ones such as LoRA adapters). Makers receive into these same tensors of their model."""

    def after_sync(self, model: nn.Module) -> None:
        """Maker side, after new sync tensors were written: rebuild derived weights (e.g. merge LoRA
        into a pristine base copy — never accumulate). No-op for most workloads."""

    def make_collector(self, rank_seed: int, device: torch.device) -> "Collector":
        """Maker-side rollout state (envs, prompt stream)."""

    def default_config(self) -> PPOConfig:
        """The workload's PPO hyper-parameters (optional; ``PPOConfig()`` otherwise)."""

    # Optional hooks: ``build_maker_model(seed, device)`` (what makers build instead of build_model,
    # e.g. without a critic; sync_tensors must be the same), ``shard_units(model)`` (the FSDP units
    # for --strategy fsdp: submodules innermost first, then the roots whose forward the learner calls),
    # ``save_artifacts(model_state)`` (trainer 0 after every checkpoint, with the full model state).

    def make_learner(self, model: nn.Module, cfg: PPOConfig, grad_sync: Any) -> "Learner":
        """Trainer-side optimiser state; ``grad_sync`` averages gradients over the trainer group
        (an :class:`hpcrl.comm.GradSync` over ``model``'s trainable parameters)."""


class Collector(Protocol):
    """Optional: ``assign(batch, seed)`` — called by a maker before each ``collect`` with the run's
    batch number (from the trainer's credit: ``credit_id x trainers + trainer``, unique in the run and
    continued across a resume) and the run's seed; a collector over a dataset (prompts) serves a fixed
    slice for each batch, so makers split the data and a resumed run continues with the next item."""

    def collect(self, model: nn.Module, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """One experience batch (fixed shapes) and rollout stats (e.g. ``episode_return_sum``,
        ``episodes``, ``env_steps``) as plain floats."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Learner(Protocol):
    def update(self, batches: list[dict[str, torch.Tensor]], generator: torch.Generator) -> dict[str, float]:
        """PPO epochs/minibatches on the concatenated batches (advantages computed here, with the
        current critic); returns scalar stats (policy_loss, value_loss, entropy, approx_kl, clip_frac, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdamLearner:
    """What the token-level learners (``lm``, ``hf``) share: Adam over the trainable parameters, an update
    counter, and zeroing the gradients where GradSync keeps them (its flat buffer) as well as in Adam."""

    def __init__(self, model: nn.Module, cfg: PPOConfig, grad_sync: Any) -> None:
        self.model, self.cfg, self.grad_sync = model, cfg, grad_sync
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr, eps=1e-5)
        self.updates = 0

    def _zero_grad(self) -> None:
        zero = getattr(self.grad_sync, "zero_grad", None)
        if zero is not None:
            zero()
        self.opt.zero_grad(set_to_none=False)
