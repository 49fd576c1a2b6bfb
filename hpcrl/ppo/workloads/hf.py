"""RLHF on real Hugging Face models through detached PPO (docs/coati.md: the seed's coati/ray task
with transformers models instead of the in-house ``lm`` workload's).

Until ``--workload hf`` is registered, run it as a plugin (its flags are :class:`HFOptions`)::

    python -m hpcrl.ppo --workload hpcrl.ppo.workloads.hf:HFWorkload --model DIR --reward-fn pkg.mod:fn \\
        --prompts prompts.jsonl --makers 1 --trainers 1 --total-steps 20 --run-dir runs/hf --ppo.lr 1e-5

Roles (the same split as :mod:`hpcrl.ppo.workloads.lm`):

* **makers** hold the actor (receiving its weights), a frozen reference copy loaded from ``--model``
  (not with ``--ref-on trainers``) and the reward model / function. Per experience batch:
  ``batch_size`` prompts from the dataset (:mod:`.hf_prompts`; ``group_size`` samples each with
  GRPO), left-padded; ``generate`` with the KV cache (:mod:`.hf_generate`); one full forward of actor
  and reference over prompt + response for ``behaviour_logp`` / ``ref_logp`` of the sampled tokens
  (tempered by ``--temperature``); the score
  (one number per sequence). Everything has fixed shapes: prompts padded to ``max_prompt_tokens``,
  responses to ``max_new_tokens``, with real ``attention_mask`` / ``action_mask``.
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
  Makers merge (:meth:`HFWorkload.after_publish`): each adapted weight is rebuilt as ``W0 + s B A`` from a
  pristine copy of ``W0`` at every publish (as the ``lm`` workload's LoRA path does), never accumulated.
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
  shards one safetensors file at a time (:mod:`.hf_export`), no model built, no host copy kept.
* **trainer strategies** (``--strategy ddp|fsdp``, :mod:`hpcrl.ppo.strategy`): FSDP2 units are the
  decoder layers of actor and critic, then actor and critic (:meth:`HFWorkload.shard_units`). Under
  fsdp the trainers build the model on ``meta`` and each reads only its own rows of the weights files
  (:mod:`.hf_shards`, :meth:`HFWorkload.materialize`): per-trainer host memory for the model falls as 1/N.
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

import copy
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from hpcrl.config_check import ConfigError

from ..workload import PPOConfig, Workload
from . import hf_models as M
from .hf_collector import HFCollector, left_pad
from .hf_export import DEFAULT_MAX_SHARD_SIZE
from .hf_generate import SamplingParams, position_ids
from .hf_learner import HFLearner, group_advantages
from .hf_options import HFOptions
from .hf_prompts import load_records

__all__ = ["HFActorCritic", "HFCollector", "HFLearner", "HFOptions", "HFWorkload", "RegisteredHFWorkload",
           "group_advantages", "left_pad"]


class HFActorCritic(nn.Module):
    """Actor (a transformers causal LM, maybe peft-wrapped) + optional critic (:class:`ValueModel`), and
    on trainers under ``--ref-on trainers`` the frozen ``reference`` (not a submodule: never trained,
    checkpointed or published, so a checkpoint is the same under either ``--ref-on``)."""

    def __init__(self, actor: nn.Module, critic: nn.Module | None, prompt_len: int, temperature: float,
                 reference: nn.Module | None = None) -> None:
        super().__init__()
        self.actor, self.critic = actor, critic
        self.__dict__["reference"] = reference
        self.prompt_len, self.temperature = prompt_len, temperature
        self.publishes = 0

    @property
    def compute_device(self) -> torch.device:
        """Where forward passes run: the parameters' device, or under FSDP the mesh's (the shards may be
        offloaded to host memory; FSDP gathers them onto the device for compute)."""
        p = next(self.parameters())
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            return p.device
        if mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(mesh.device_type)

    def action_logits(self, tokens: Tensor, attn: Tensor, net: nn.Module | None = None) -> Tensor:
        """``[B, G, V]`` logits scoring the ``G`` response tokens (positions ``P - 1 .. P + G - 2``)."""
        g = tokens.shape[1] - self.prompt_len
        out = (net or self.actor)(input_ids=tokens, attention_mask=attn.long(), position_ids=position_ids(attn),
                                  use_cache=False, logits_to_keep=g + 1)
        return out.logits[:, :-1]

    def values(self, tokens: Tensor, attn: Tensor) -> Tensor:
        """``[B, G]`` critic values of the states before each response token."""
        v = self.critic(tokens, attn.long(), position_ids(attn))
        return v[:, self.prompt_len - 1:-1]


@dataclass
class HFWorkload(HFOptions, Workload):
    """The ``hf`` workload; constructing it checks every input it can without loading weights."""

    name = "hf"

    def __post_init__(self) -> None:
        try:
            self._setup()
        except ConfigError as err:
            raise self.renamed(err) from None

    def _setup(self) -> None:
        self.check()
        config = M.load_config(self.flag("model"), self.model)
        self.param_dtype = M.resolve_dtype(self.dtype, config, self.flag("dtype"), self.model)
        self.model_types = [config.model_type]
        if self.critic is not None:
            self.model_types.append(M.load_config(self.flag("critic"), self.critic).model_type)
        if self.reward_model is not None:
            M.check_reward_model(self.reward_model)
        if self.lora_rank:
            try:
                import peft  # noqa: F401
            except ImportError:
                raise ConfigError(f"--lora-rank {self.lora_rank} needs the peft package: pip install peft, or "
                                  "--lora-rank 0") from None
        limit = M.context_length(config)
        total = self.max_prompt_tokens + self.max_new_tokens
        if limit is not None and total > limit:
            raise ConfigError(f"--max-prompt-tokens {self.max_prompt_tokens} + --max-new-tokens {self.max_new_tokens} "
                              f"= {total} tokens: more than the model's context of {limit}; lower them to a sum "
                              f"<= {limit}")
        self.tokenizer = M.load_tokenizer(self.model)
        self.eos_id, self.pad_id = int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id)
        self.records = load_records(self.prompts, self.prompt_key)
        self.prompt_texts, self.prompt_ids = self._encode(self.records, "prompts")
        self.eval_records: list[dict[str, Any]] = []
        self.eval_texts, self.eval_ids = [], []
        if self.eval_prompts is not None:
            self.eval_records = load_records(self.eval_prompts, self.prompt_key, self.flag("eval_prompts"))
            self.eval_texts, self.eval_ids = self._encode(self.eval_records, "eval_prompts")
        self.reward_callable = M.import_reward_fn(self.reward_fn) if self.reward_fn else None
        self.reward_takes = "prompts"
        if self.reward_callable is not None:  # a probe before any rank starts: raises / wrong length, named
            self.reward_takes = M.reward_takes(self.reward_callable, self.reward_fn)
            probe = self.reward_inputs([0, 1][:len(self.records)], self.records, self.prompt_texts)
            M.call_reward_fn(self.reward_callable, self.reward_fn, probe, self.prompt_texts[:2], batch="probe")
        self.sampling = SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        self._refs: dict[str, nn.Module] = {}
        self._rms: dict[str, nn.Module] = {}

    def _encode(self, records: list[dict[str, Any]], flag: str) -> tuple[list[str], list[list[int]]]:
        """``(texts, token ids)`` of the records of ``--prompts`` or ``--eval-prompts`` (``flag``): the
        texts are what a prompts-reward receives (a chat record's: its templated text)."""
        path, texts, out, long = getattr(self, flag), [], [], []
        for i, record in enumerate(records):
            where = f"--{flag.replace('_', '-')} {path}: record {i}"
            text, templated = M.format_record(self.tokenizer, record, self.prompt_key, self.chat_template, where)
            ids = list(self.tokenizer(text, add_special_tokens=not templated)["input_ids"])
            if not ids:
                raise ConfigError(f"{where} tokenizes to nothing; drop empty prompts")
            if len(ids) > self.max_prompt_tokens:
                long.append((i, len(ids)))
                ids = ids[-self.max_prompt_tokens:]
            texts.append(record[self.prompt_key] if isinstance(record.get(self.prompt_key), str) else text)
            out.append(ids)
        if long:
            i, n = max(long, key=lambda x: x[1])
            what = (f"{len(long)} prompt(s) longer than --max-prompt-tokens {self.max_prompt_tokens} (longest: record "
                    f"{i}, {n} tokens)")
            if not self.truncate_prompts:
                raise ConfigError(f"--{flag.replace('_', '-')} {path}: {what}; raise --max-prompt-tokens to {n} or "
                                  "pass --truncate-prompts to keep their last tokens")
            print(f"hpcrl.ppo hf: warning: {what}: truncated to their last {self.max_prompt_tokens} tokens",
                  file=sys.stderr, flush=True)
        return texts, out

    def reward_inputs(self, idx: list[int], records: list[dict[str, Any]], texts: list[str]) -> list[Any]:
        """What ``--reward-fn`` receives for the prompts ``idx``: copies of the records (every field), or
        the prompt texts, by its first parameter (:func:`~.hf_models.reward_takes`)."""
        if self.reward_takes == "records":
            return [dict(records[i]) for i in idx]
        return [texts[i] for i in idx]

    def default_config(self) -> PPOConfig:
        """gamma = 1 (the episode is the response), lr 1e-5 (full fine-tuning of a pretrained model; 1e-4 with
        LoRA; a tiny model such as the demo's wants 1e-3: docs/hf_learning.md), KL 0.01 (ppo) or 0 (grpo)."""
        kl = self.kl_coef if self.kl_coef is not None else (0.0 if self.algo == "grpo" else 0.01)
        return PPOConfig(epochs=2, minibatches=2, lr=1e-4 if self.lora_rank else 1e-5, gamma=1.0, gae_lambda=0.95,
                         clip_coef=0.2, value_clip_coef=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=1.0,
                         kl_coef=kl)

    # -- models ----------------------------------------------------------------------------------
    def _lora_config(self) -> Any:
        import peft

        return peft.LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha or self.lora_rank, lora_dropout=0.0,
                               target_modules="all-linear", bias="none")

    def _lora(self, net: nn.Module) -> nn.Module:
        import peft

        # adapters in the base weights' dtype: one dtype per FSDP unit, and bf16 weights stay bf16
        return peft.get_peft_model(net, self._lora_config(), autocast_adapter_dtype=False)

    builds_on_meta = True
    """Under --strategy fsdp the trainers build the model empty (``build_model(seed, "meta")``) and
    fill their shards after ``fully_shard`` (:meth:`materialize`)."""

    def build_model(self, seed: int, device: torch.device | str = "cpu", critic: bool = True) -> HFActorCritic:
        """Pretrained weights by path in ``--dtype`` (identical on every rank); the parameters no file
        holds (value head, LoRA adapters) from the seed (:func:`~.hf_shards.fresh_value`).
        ``critic=False``: the actor alone (what a maker needs). ``--ref-on trainers`` without LoRA: the
        trainers' model also holds the frozen reference (:meth:`_trainer_reference`). ``device="meta"``:
        nothing is read or allocated: the weights files are named on the model, for :meth:`materialize`
        after sharding."""
        from .hf_shards import WeightFiles, sources

        empty = torch.device(device).type == "meta"
        dtype = self.param_dtype
        actor = M.empty_causal_lm(self.model, dtype) if empty else M.load_causal_lm(self.model, dtype)
        reference = self._trainer_reference(empty) if critic else None
        critic = None if self.algo == "grpo" or not critic else M.load_value_model(self.critic or self.model, dtype,
                                                                                     empty)
        load = []
        if empty:  # before LoRA wraps the layers: the stored names are the bare models'
            actor_files = WeightFiles(self.model, self.flag("model"))
            load.append((actor_files, sources(actor, actor_files)))
            if reference is not None:
                load.append((actor_files, sources(reference, actor_files)))
            if critic is not None:
                critic_files = (actor_files if (self.critic or self.model) == self.model
                                else WeightFiles(self.critic, self.flag("critic")))
                load.append((critic_files, sources(critic.backbone, critic_files)))
        for net in (actor, critic):
            if net is None:
                continue
            for m in net.modules():  # no dropout anywhere: maker and trainer evaluate the same function
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
            if self.gradient_checkpointing:
                inner = net.backbone if isinstance(net, M.ValueModel) else net
                inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_rank:  # peft's own random init is overwritten below: no global random state is drawn
            with torch.random.fork_rng(devices=[]):
                actor = self._lora(actor)
                if critic is not None:
                    critic.backbone = self._lora(critic.backbone)
                    critic.value_head.requires_grad_(True)
        model = HFActorCritic(actor, critic, self.max_prompt_tokens, self.temperature, reference)
        fresh = [(n, *_owner(model, n)) for n, _ in model.named_parameters() if _is_fresh(n)]
        if empty:
            model.__dict__["_hpcrl_load"] = (load, fresh, seed)  # not a submodule: never saved or published
            return model
        with torch.no_grad():
            for name, module, attr in fresh:
                p = getattr(module, attr)
                p.copy_(_fresh(name, p, seed))
        if reference is not None:
            reference.to(device)
        return model.to(device)

    def _trainer_reference(self, empty: bool) -> nn.Module | None:
        """The frozen reference a trainer holds under ``--ref-on trainers``: ``--model`` again in ``--dtype``
        (on ``meta`` when ``empty``: sharded and filled like the actor), eval mode, no gradients. None with
        makers computing ``ref_logp``, and with LoRA: there the reference is the actor's own base with its
        adapters disabled (:meth:`HFLearner.reference_logp <.hf_learner.HFLearner.reference_logp>`)."""
        if self.ref_on != "trainers" or self.lora_rank:
            return None
        ref = M.empty_causal_lm(self.model, self.param_dtype) if empty else M.load_causal_lm(self.model,
                                                                                              self.param_dtype)
        for m in ref.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return ref.eval().requires_grad_(False)

    @torch.no_grad()
    def materialize(self, model: HFActorCritic) -> None:
        """Fill the parameters of a model built by ``build_model(seed, "meta")``, once FSDP has sharded it
        and ``to_empty`` allocated the shards: each trainer reads only its own dim-0 rows of each stored
        tensor (:class:`~.hf_shards.WeightFiles`), converted to the parameter dtype; the fresh ones get
        their rows of :func:`~.hf_shards.fresh_value`."""
        from ..strategy import local_rows

        load, fresh, seed = model.__dict__.pop("_hpcrl_load")
        reference = model.reference
        if reference is not None:  # not a submodule: the strategy's to_empty did not reach it
            _, _, shard = local_rows(next(model.actor.parameters()))
            buffers = [(m, n, b) for m in reference.modules() for n, b in m._buffers.items() if b is not None]
            reference.to_empty(device=shard.device)  # where the actor's shards are (host memory with offload)
            for m, n, b in buffers:  # built for real (rotary inv_freq): kept, on the compute device
                m._buffers[n] = b.to(model.compute_device)
            # a frozen root never runs a backward that would free its gathered weights: free them after
            # each forward (FSDP keeps a root's gathered by default), so its host memory stays 1/N
            reference.set_reshard_after_forward(True)
        for files, entries in load:
            for module, attr, key in entries:
                p = getattr(module, attr)
                start, stop, local = local_rows(p)
                if stop > start or p.dim() == 0:
                    local.copy_(files.rows(key, start, stop))
            files.close()
        for name, module, attr in fresh:
            p = getattr(module, attr)
            start, stop, local = local_rows(p)
            local.copy_(_fresh(name, p, seed)[start:stop] if p.dim() else _fresh(name, p, seed))

    def build_maker_model(self, seed: int, device: torch.device | str = "cpu") -> HFActorCritic:
        """Makers generate and score with the actor only: no critic is loaded."""
        return self.build_model(seed, device, critic=False)

    def rank_modules(self) -> tuple[str, ...]:
        """This module, the models' modeling code (transformers imports it on first use: ~1-2 s a rank)
        and peft with LoRA."""
        modeling = [f"transformers.models.{t}.modeling_{t}" for t in (m.replace("-", "_") for m in self.model_types)]
        return (type(self).__module__, *dict.fromkeys(modeling), *(["peft"] if self.lora_rank else []))

    def shard_units(self, model: HFActorCritic) -> list[nn.Module]:
        """FSDP units (``--strategy fsdp``): every decoder layer of actor, critic and a trainer-side
        reference (the classes transformers names in ``_no_split_modules``), then each of them as a root
        (the learner calls their forward)."""
        units: list[nn.Module] = []
        for net in (model.actor, model.critic, model.reference):  # the reference: frozen, sharded as the actor
            if net is None:
                continue
            inner = net.backbone if isinstance(net, M.ValueModel) else net
            base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
            names = set(getattr(base, "_no_split_modules", None) or ())
            layers = [m for m in net.modules() if type(m).__name__ in names]
            if not layers:
                raise ConfigError(f"--strategy fsdp: {type(base).__name__} names no decoder layer class "
                                  "(_no_split_modules) to shard by; use --strategy ddp")
            units += [*layers, net]
        return units

    def reference_model(self, device: torch.device) -> nn.Module:
        """The makers' frozen reference (``--ref-on makers``), loaded at its first use on ``device``."""
        key = str(device)
        if key not in self._refs:
            self._refs[key] = M.load_causal_lm(self.model, self.param_dtype).to(device).eval().requires_grad_(False)
        return self._refs[key]

    def reward_net(self, device: torch.device) -> nn.Module:
        key = str(device)
        if key not in self._rms:
            self._rms[key] = M.load_reward_model(self.reward_model, self.pad_id).to(device)
        return self._rms[key]

    def _publish_items(self, model: HFActorCritic) -> list[tuple[str, Tensor]]:
        items = list(model.actor.named_parameters())
        if self.lora_rank:
            items = [(n, p) for n, p in items if "lora_" in n]
            trainable = [n for n, p in model.actor.named_parameters() if p.requires_grad]
            if trainable != [n for n, _ in items] or not items:
                raise ValueError(f"LoRA mode: trainable actor parameters {trainable[:4]} are not exactly the adapters")
        return items

    def publish_tensors(self, model: HFActorCritic) -> list[Tensor]:
        """The actor's parameters (all, or only the LoRA adapters) in named_parameters order."""
        return [p.data for _, p in self._publish_items(model)]

    @torch.no_grad()
    def after_publish(self, model: HFActorCritic) -> None:
        """Maker side, after new weights were written: merge LoRA (:meth:`_merge`); a reduced-precision
        maker copy (:meth:`maker_actor`) is rebuilt from them at the next collect."""
        model.publishes += 1  # a reduced-precision maker copy is rebuilt from these weights (maker_actor)
        self._merge(model)

    def maker_actor(self, model: HFActorCritic) -> nn.Module:
        """The network a maker generates and scores with: the actor itself (fp32), or a bf16 / int8 copy
        made from its current (merged) weights, cached until the next publish."""
        if self.maker_dtype == "fp32":
            return model.actor
        cached = model.__dict__.get("_maker_copy")
        if cached is not None and cached[0] == model.publishes:
            return cached[1]
        net = copy.deepcopy(model.actor)
        if self.lora_rank:
            net = net.unload()  # the base layers already hold W0 + s B A (after_publish), or W0 with B = 0
        if self.maker_dtype == "bf16":
            net = net.to(torch.bfloat16)
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
                net = torch.ao.quantization.quantize_dynamic(net.cpu().float(), {nn.Linear}, dtype=torch.qint8)
        net = net.eval().requires_grad_(False)
        model.__dict__["_maker_copy"] = (model.publishes, net)  # not a submodule: never published or checkpointed
        return net

    @torch.no_grad()
    def _merge(self, model: HFActorCritic) -> None:
        """Maker side. Full weights: nothing to do (written in place). LoRA: every adapted layer's base
        weight becomes ``W0 + s * B @ A`` rebuilt from a pristine copy of ``W0`` taken at the first publish
        (never accumulated), and peft is told the layer is merged, so inference runs on plain matrices.
        Only makers call this; a trainer's forward stays peft's unmerged, differentiable one."""
        if not self.lora_rank:
            return
        from peft.tuners.lora import LoraLayer

        for module in model.actor.modules():
            if not isinstance(module, LoraLayer):
                continue
            base = module.get_base_layer().weight
            pristine = getattr(module, "_hpcrl_pristine", None)
            if pristine is None:
                pristine = module._hpcrl_pristine = base.detach().clone()
            for name in module.active_adapters:
                base.copy_(pristine + module.get_delta_weight(name).to(base.dtype))
            module.merged_adapters = list(module.active_adapters)

    export_max_shard_size: ClassVar[int | str] = DEFAULT_MAX_SHARD_SIZE
    """The largest safetensors file of an ``actor`` export (save_pretrained's ``max_shard_size``): an export
    holds one file's tensors at a time."""

    @torch.no_grad()
    def save_artifacts(self, state: dict[str, Tensor], out_dir: str | os.PathLike | None = None) -> Path | None:
        """``out_dir/actor`` (default ``--save-dir``; nothing without one): the actor of the full model
        state ``state`` (LoRA merged) and the tokenizer, as save_pretrained writes it, loadable by
        ``AutoModelForCausalLM.from_pretrained`` (:func:`~.hf_export.write_pretrained`; no model built).
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
        """``out_dir/actor`` from ``source``, written to a temporary sibling and renamed, so a reader never
        sees half a model; the model's ``meta`` skeleton names the tensors (nothing allocated, nothing kept)."""
        from .hf_export import meta_causal_lm, peft_scaling, write_pretrained

        out_dir = out_dir if out_dir is not None else self.save_dir
        if out_dir is None:
            return None
        out = Path(out_dir) / "actor"
        tmp = out.with_name(f".actor.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        skeleton = meta_causal_lm(self.model, self.param_dtype)
        scaling = rank = None
        if self.lora_rank:
            cfg = self._lora_config()
            scaling, rank = peft_scaling(cfg.lora_alpha, cfg.r, cfg.use_rslora), cfg.r
        try:
            write_pretrained(source, tmp, skeleton, self.param_dtype, tokenizer=self.tokenizer,
                             generation_config=self._generation_config(skeleton), lora_scaling=scaling,
                             lora_rank=rank, max_shard_size=self.export_max_shard_size)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = out.with_name(f".actor.old{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        return out

    def _generation_config(self, skeleton: nn.Module) -> Any:
        """What ``from_pretrained(--model)`` gives the actor (its generation_config.json, else one made from
        the model config); None for a model that does not generate (save_pretrained writes none)."""
        if not skeleton.can_generate():
            return None
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.model)
        except OSError:
            return skeleton.generation_config

    # -- roles -----------------------------------------------------------------------------------
    def make_collector(self, rank_seed: int, device: torch.device | str = "cpu") -> HFCollector:
        if self.maker_dtype == "int8" and torch.device(device).type != "cpu":
            raise self.renamed(ConfigError(f"--maker-dtype int8 on {device}: int8 makers use torch's dynamic "
                                           "quantization, which runs on CPU; pass --maker-device cpu, or "
                                           "--maker-dtype bf16 on GPU makers"))
        return HFCollector(self, rank_seed, torch.device(device))

    def make_learner(self, model: HFActorCritic, cfg: PPOConfig, grad_average: Any) -> HFLearner:
        return HFLearner(self, model, cfg, grad_average)


def _is_fresh(name: str) -> bool:
    """A parameter no weights file holds: a LoRA adapter or the value head."""
    return "lora_" in name or name.startswith("critic.value_head.")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def _fresh(name: str, p: Tensor, seed: int) -> Tensor:
    from .hf_shards import fresh_value

    return fresh_value(name, tuple(p.shape), p.dtype, seed)


@dataclass
class RegisteredHFWorkload(HFWorkload):
    """:class:`HFWorkload` as ``--workload hf`` with an ``--hf.*`` option group: messages say ``--hf.model``."""

    FLAG_PREFIX = "--hf."
