"""RLHF on real Hugging Face models through detached PPO (docs/coati.md: the seed's coati/ray task
with transformers models instead of the in-house ``lm`` workload's).

Registered as ``--workload hf`` (its flags are the ``--hf.*`` group, :class:`HFOptions`); as a plugin the
same options are its own flags::

    python -m hpcrl.ppo --workload hpcrl.ppo.workloads.hf:HFWorkload --model DIR --reward-fn pkg.mod:fn \\
        --prompts prompts.jsonl --makers 1 --trainers 1 --total-steps 20 --run-dir runs/hf --ppo.lr 1e-5

:class:`HFWorkload` composes three parts built from the options and hands each to the roles that need
it: the options themselves (:class:`HFOptions`: no state), the task (:class:`~.hf_task.HFTask`: tokenizer,
records, reward) and the model factory (:class:`~.hf_factory.HFModelFactory`: actor, critic, reference,
LoRA, dtype, sharded loading); the collector (:mod:`.hf_collector`), learner (:mod:`.hf_learner`) and
evaluation (:mod:`.hf_eval`) read those, not the workload.

Roles (the same split as :mod:`hpcrl.ppo.workloads.lm`):

* **makers** hold the actor (receiving its weights), a frozen reference copy loaded from ``--model``
  (not with ``--ref-on trainers``) and the reward model / function. Per experience batch:
  ``batch_size`` prompts from the dataset (:mod:`.hf_prompts`; ``group_size`` samples each with
  GRPO), left-padded; ``generate`` with the KV cache through the engine (``--engine``, :mod:`.hf_engine`:
  ragged responses with their behaviour log-probs); with ``--ref-on makers`` one reference forward for
  ``ref_logp``; the score (one number per sequence). The batch is laid out padded (prompts to
  ``max_prompt_tokens``, episodes to ``max_new_tokens`` or ``--max-episode-tokens``, with real
  ``attention_mask`` / ``action_mask``) and shipped as each row's span (:mod:`hpcrl.ppo.ragged`).
* **trainers**: token-level PPO — per-token KL penalty to the reference (k1 / k3) plus the score at
  the last response token, GAE over response tokens with the *current* critic (a value head on the
  actor's backbone, or on ``--critic``), whitened advantages, clipped policy and value losses (coati's
  ``eps_clip`` / ``value_clip`` are ``--ppo.clip-coef`` / ``--ppo.value-clip-coef``). ``--algo grpo``:
  no critic; ``group_size`` samples per prompt; advantage = (score - group mean) / (group std + eps)
  on every response token; the KL to the reference as a k3 loss term (``kl_coef``).
* **reference on trainers** (``--ref-on trainers``): makers hold the actor alone and send no
  ``ref_logp``; each trainer computes it for every received batch before the PPO epochs
  (:meth:`HFLearner.reference_logp <.hf_learner.HFLearner.reference_logp>`), tempered as the makers do,
  with a frozen reference held as the actor is: under fsdp built on ``meta``, one FSDP unit per decoder
  layer, its rows read from the weights files (1/N per trainer; ``--trainer-dtype bf16`` computes it
  in bf16 as the actor); under ddp a full copy; with LoRA the actor's base with the adapters disabled
  (no second model). Not the makers' LoRA path: their layers hold merged weights, which peft's
  ``disable_adapter`` would unmerge by subtraction (not the stored ``W0`` bit for bit).
* **LoRA** (``--lora-rank R``, needs peft): adapters on every linear layer of actor and critic
  backbones; only they (and the value head) are trained; only the actor's adapters are published.
  Makers merge (:meth:`~.hf_factory.HFModelFactory.merge_lora`): each adapted weight is rebuilt as
  ``W0 + s B A`` from a pristine copy of ``W0`` at every publish (as the ``lm`` workload's LoRA path
  does), never accumulated.
* **maker precision** (``--maker-dtype bf16|int8``): makers generate and score with a bf16 copy or an
  int8 dynamically quantized copy (torch's, CPU) of the actor, re-made from the received fp32 weights
  at every swap; its log-probs are the behaviour ones, and ``maker_logp_gap`` (mean |log pi_trainer -
  log pi_maker| per token before each update) measures the gap the off-policy correction absorbs.
* **metrics** (``metrics.jsonl`` / TensorBoard through the trainer's row): ``score`` (reward mean),
  ``score_std``, ``kl_to_ref`` (k1, per sequence), ``kl_to_ref_k3``, ``response_len``, ``eos_frac``,
  ``entropy``, ``clip_frac``, ``value_loss``, ``explained_variance``, ``maker_tokens_per_s``,
  ``trainer_tokens_per_s``, ``maker_logp_gap``.
* **artefacts**: with ``--save-dir DIR`` (``RUN_DIR/hf`` under ``--workload hf``) trainer 0 writes the
  actor as ``save_pretrained`` would (LoRA merged) plus the tokenizer to ``DIR/actor`` at every
  checkpoint and at the end (:meth:`HFWorkload.export_checkpoint`): streamed from the checkpoint's DCP
  shards one safetensors file at a time (:func:`~.hf_export.write_actor`), no model built, no host copy
  kept.
* **trainer strategies** (``--strategy ddp|fsdp``, :mod:`hpcrl.ppo.strategy`): FSDP2 units are the
  decoder layers of actor and critic, then actor and critic (:meth:`~.hf_factory.HFModelFactory.shard_units`).
  Under fsdp the trainers build the model on ``meta`` and each reads only its own rows of the weights
  files (:mod:`.hf_shards`, :meth:`~.hf_factory.HFModelFactory.materialize`): per-trainer host memory
  for the model falls as 1/N.
* **dtype** (``--dtype auto|fp32|bf16``): the parameters' dtype everywhere (trainers, makers' actor,
  reference); auto = the stored one. Parameters no file holds (LoRA adapters, value head) come from the
  seed and their name (:func:`~.hf_shards.fresh_value`): the same under ddp and fsdp, on every rank.
* **records**: a dataset line is a record with any fields (``answer``, ``tests``, ``meta``) and a prompt
  under ``--prompt-key`` or chat ``messages`` (through the tokenizer's chat template). The records stay
  on the makers (only tokens travel); a reward function whose first parameter is ``records`` gets
  copies of them, one whose first parameter is ``prompts`` the prompt texts (:func:`~.hf_models.reward_takes`).
* **evaluation** (``--eval-prompts``, ``--eval-every N``): after every N-th update each trainer answers
  the held-out records greedily (plus ``--eval-samples`` sampled answers) with the current actor and
  scores them (:mod:`.hf_eval`): ``eval_reward``, ``eval_pass_rate``, ``eval_records`` in that update's
  row. Trainers, not makers, because only they know the version: every trainer computes the same
  numbers from the same weights, drawing from no training random stream.
* **prompts**: batch ``b`` of a run is a fixed slice of the shuffled dataset (:meth:`HFCollector.assign`,
  numbered by the trainers' credits): makers split the dataset, a resume continues with the next prompt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

from ..workload import Capabilities, PPOConfig, Workload
from .hf_collector import HFCollector, left_pad
from .hf_export import DEFAULT_MAX_SHARD_SIZE
from .hf_factory import HFActorCritic, HFModelFactory
from .hf_env import check_env
from .hf_learner import HFLearner, group_advantages
from .hf_options import HFGroupOptions, HFOptions
from .hf_task import HFTask

__all__ = ["HFActorCritic", "HFCollector", "HFLearner", "HFOptions", "HFWorkload", "RegisteredHFWorkload",
           "group_advantages", "left_pad"]


@dataclass
class HFWorkload(HFOptions, Workload):
    """The ``hf`` workload. Its fields are the :class:`HFOptions` (a plugin's flags); constructing it
    checks every input it can without loading weights and builds what it composes: ``options`` (a plain
    copy of them), ``task`` (:class:`~.hf_task.HFTask`) and ``models``
    (:class:`~.hf_factory.HFModelFactory`). Each hook hands them on."""

    name = "hf"
    options_class: ClassVar[type[HFOptions]] = HFOptions
    """How the options spell their flags in messages (:attr:`HFOptions.FLAG_PREFIX`)."""
    export_max_shard_size: ClassVar[int | str] = DEFAULT_MAX_SHARD_SIZE
    """The largest safetensors file of an ``actor`` export (save_pretrained's ``max_shard_size``): an export
    holds one file's tensors at a time."""

    def __post_init__(self) -> None:
        options = self.options_class(**self.kwargs())
        try:
            options.check()
            self.models = HFModelFactory(options)
            self.task = HFTask(options)
            if options.multi_turn:
                check_env(options, self.task)
        except ConfigError as err:
            raise options.renamed(err) from None
        self.options = options

    def default_config(self) -> PPOConfig:
        """gamma = 1 (the episode is the response), lr 1e-5 (full fine-tuning of a pretrained model; 1e-4 with
        LoRA; a tiny model such as the demo's wants 1e-3: docs/hf_learning.md), KL 0.01 (ppo) or 0 (grpo)."""
        o = self.options
        kl = o.kl_coef if o.kl_coef is not None else (0.0 if o.algo == "grpo" else 0.01)
        return PPOConfig(epochs=2, minibatches=2, lr=1e-4 if o.lora_rank else 1e-5, gamma=1.0, gae_lambda=0.95,
                         clip_coef=0.2, value_clip_coef=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=1.0,
                         kl_coef=kl)

    def capabilities(self) -> Capabilities:
        """Under fsdp the trainers build the model on ``meta`` and fill their shards (:meth:`materialize`);
        trainer 0 exports the actor after every checkpoint, streamed from its shards (with ``--save-dir``)."""
        return Capabilities(builds_on_meta=True, saves_artifacts=True, exports_from_shards=True)

    # -- models ----------------------------------------------------------------------------------
    def build_model(self, seed: int, device: torch.device | str = "cpu", critic: bool = True) -> HFActorCritic:
        """:meth:`HFModelFactory.build <.hf_factory.HFModelFactory.build>`."""
        return self.models.build(seed, device, critic)

    def build_maker_model(self, seed: int, device: torch.device | str = "cpu") -> HFActorCritic:
        """Makers generate and score with the actor only: no critic is loaded."""
        return self.models.build(seed, device, critic=False)

    def materialize(self, model: HFActorCritic) -> None:
        self.models.materialize(model)

    def shard_units(self, model: HFActorCritic) -> list[nn.Module]:
        return self.models.shard_units(model)

    def rank_modules(self) -> tuple[str, ...]:
        """This module, the models' modeling code (transformers imports it on first use: ~1-2 s a rank)
        and peft with LoRA."""
        types = (m.replace("-", "_") for m in self.models.model_types)
        modeling = [f"transformers.models.{t}.modeling_{t}" for t in types]
        return (type(self).__module__, *dict.fromkeys(modeling), *(["peft"] if self.options.lora_rank else []))

    def publish_tensors(self, model: HFActorCritic) -> list[Tensor]:
        return self.models.publish_tensors(model)

    def after_publish(self, model: HFActorCritic) -> None:
        self.models.after_publish(model)

    # -- artefacts -------------------------------------------------------------------------------
    @torch.no_grad()
    def save_artifacts(self, state: dict[str, Tensor], out_dir: str | os.PathLike | None = None) -> Path | None:
        """``out_dir/actor`` (default ``--save-dir``; nothing without one): the actor of the full model
        state ``state`` (LoRA merged) and the tokenizer, as save_pretrained writes it, loadable by
        ``AutoModelForCausalLM.from_pretrained`` (:func:`~.hf_export.write_actor`; no model built).
        Trainer 0's per-checkpoint export reads the checkpoint's shards instead (:meth:`export_checkpoint`)."""
        from .hf_export import StateTensors

        return self._write_actor(StateTensors(state), out_dir)

    @torch.no_grad()
    def export_checkpoint(self, dcp_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path | None:
        """:meth:`save_artifacts` of the model state in the DCP checkpoint ``dcp_dir`` (``model.actor.*``),
        streamed: read one safetensors shard's tensors at a time (:class:`~.hf_export.CheckpointTensors`),
        merged, written, dropped. Trainer 0 calls it after every checkpoint (on the writer thread), and
        ``python -m hpcrl.ppo.export``."""
        from .hf_export import CheckpointTensors

        return self._write_actor(CheckpointTensors(dcp_dir), out_dir)

    def _write_actor(self, source: Any, out_dir: str | os.PathLike | None) -> Path | None:
        from .hf_export import write_actor

        out_dir = out_dir if out_dir is not None else self.options.save_dir
        if out_dir is None:
            return None
        return write_actor(source, out_dir, self.options.model, self.models.param_dtype,
                           tokenizer=self.task.tokenizer, lora_config=self.models.lora_config(),
                           max_shard_size=self.export_max_shard_size)

    # -- roles -----------------------------------------------------------------------------------
    def make_collector(self, rank_seed: int, device: torch.device | str = "cpu") -> HFCollector:
        if self.options.maker_dtype == "int8" and torch.device(device).type != "cpu":
            raise self.options.renamed(ConfigError(f"--maker-dtype int8 on {device}: int8 makers use torch's "
                                                   "dynamic quantization, which runs on CPU; pass --maker-device "
                                                   "cpu, or --maker-dtype bf16 on GPU makers"))
        return HFCollector(self.options, self.task, self.models, rank_seed, torch.device(device))

    def make_learner(self, model: HFActorCritic, cfg: PPOConfig, grad_average: Any) -> HFLearner:
        return HFLearner(self.options, self.task, model, cfg, grad_average)


@dataclass
class RegisteredHFWorkload(HFWorkload):
    """:class:`HFWorkload` as ``--workload hf`` with an ``--hf.*`` option group: messages say ``--hf.model``."""

    FLAG_PREFIX = "--hf."
    options_class = HFGroupOptions
