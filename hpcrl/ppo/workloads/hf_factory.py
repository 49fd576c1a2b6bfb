"""The ``hf`` workload's models (:class:`HFModelFactory`): the actor(-critic) in ``--dtype``, with LoRA
adapters, loaded in full or built on ``meta`` and filled per shard (:mod:`.hf_shards`), the trainers'
and the makers' frozen reference, the FSDP units, and the maker side of a publish (the published
tensors, LoRA merged into a pristine base, a reduced-precision maker copy). Constructing it reads the
model configs only (no weights) and checks what they decide (dtype, context length, peft)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

from . import hf_models as M
from .hf_generate import position_ids
from .hf_options import HFOptions

__all__ = ["HFActorCritic", "HFModelFactory"]


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

    def action_logits(self, tokens: Tensor, attn: Tensor, net: nn.Module | None = None,
                      prompt_len: int | None = None) -> Tensor:
        """``[B, G, V]`` logits scoring the ``G`` response tokens (positions ``P - 1 .. P + G - 2``; ``P`` the
        layout's prompt width, or ``prompt_len``: a later turn's context is wider)."""
        g = tokens.shape[1] - (prompt_len or self.prompt_len)
        out = (net or self.actor)(input_ids=tokens, attention_mask=attn.long(), position_ids=position_ids(attn),
                                  use_cache=False, logits_to_keep=g + 1)
        return out.logits[:, :-1]

    def values(self, tokens: Tensor, attn: Tensor) -> Tensor:
        """``[B, G]`` critic values of the states before each response token."""
        v = self.critic(tokens, attn.long(), position_ids(attn))
        return v[:, self.prompt_len - 1:-1]


class HFModelFactory:
    """Builds and loads the ``hf`` workload's models from its options (``param_dtype``: the parameters'
    dtype everywhere; ``model_types``: the transformers model types of actor and critic)."""

    def __init__(self, options: HFOptions) -> None:
        o = self.options = options
        config = M.load_config(o.flag("model"), o.model)
        self.param_dtype = M.resolve_dtype(o.dtype, config, o.flag("dtype"), o.model)
        self.model_types = [config.model_type]
        if o.critic is not None:
            self.model_types.append(M.load_config(o.flag("critic"), o.critic).model_type)
        if o.reward_model is not None:  # every model a run loads is checked before any rank starts
            M.check_reward_model(o.reward_model)
        if o.lora_rank:
            try:
                import peft  # noqa: F401
            except ImportError:
                raise ConfigError(f"--lora-rank {o.lora_rank} needs the peft package: pip install peft, or "
                                  "--lora-rank 0") from None
        if o.engine == "vllm":  # its head size and precision, before any rank starts
            from .vllm_engine import check_vllm

            check_vllm(o, config, cuda=torch.cuda.is_available())
        limit = M.context_length(config)
        total = o.max_prompt_tokens + o.episode_tokens
        if limit is not None and total > limit:
            what = "--max-new-tokens" if not o.multi_turn else "the episode's tokens (--max-episode-tokens)"
            raise ConfigError(f"--max-prompt-tokens {o.max_prompt_tokens} + {what} {o.episode_tokens} "
                              f"= {total} tokens: more than the model's context of {limit}; lower them to a sum "
                              f"<= {limit}")
        self.references: dict[str, nn.Module] = {}
        """The makers' frozen references (``--ref-on makers``) by device, loaded at their first use."""

    def lora_config(self) -> Any:
        """peft's LoraConfig of ``--lora-rank`` / ``--lora-alpha`` (None without LoRA)."""
        if not self.options.lora_rank:
            return None
        import peft

        o = self.options
        return peft.LoraConfig(r=o.lora_rank, lora_alpha=o.lora_alpha or o.lora_rank, lora_dropout=0.0,
                               target_modules="all-linear", bias="none")

    def _lora(self, net: nn.Module) -> nn.Module:
        import peft

        # adapters in the base weights' dtype: one dtype per FSDP unit, and bf16 weights stay bf16
        return peft.get_peft_model(net, self.lora_config(), autocast_adapter_dtype=False)

    def build(self, seed: int, device: torch.device | str = "cpu", critic: bool = True) -> HFActorCritic:
        """Pretrained weights by path in ``--dtype`` (identical on every rank); the parameters no file
        holds (value head, LoRA adapters) from the seed (:func:`~.hf_shards.fresh_value`).
        ``critic=False``: the actor alone (what a maker needs). ``--ref-on trainers`` without LoRA: the
        trainers' model also holds the frozen reference (:meth:`trainer_reference`). ``device="meta"``:
        nothing is read or allocated: the weights files are named on the model, for :meth:`materialize`
        after sharding."""
        o, dtype = self.options, self.param_dtype
        empty = torch.device(device).type == "meta"
        actor = M.empty_causal_lm(o.model, dtype) if empty else M.load_causal_lm(o.model, dtype)
        reference = self.trainer_reference(empty) if critic else None
        critic = None if o.algo == "grpo" or not critic else M.load_value_model(o.critic or o.model, dtype, empty)
        load = self._weight_sources(actor, reference, critic) if empty else []
        for net in (actor, critic):
            if net is not None:
                self._prepare(net)
        if o.lora_rank:  # peft's own random init is overwritten below: no global random state is drawn
            with torch.random.fork_rng(devices=[]):
                actor = self._lora(actor)
                if critic is not None:
                    critic.backbone = self._lora(critic.backbone)
                    critic.value_head.requires_grad_(True)
        model = HFActorCritic(actor, critic, o.max_prompt_tokens, o.temperature, reference)
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

    def _weight_sources(self, actor: nn.Module, reference: nn.Module | None,
                        critic: M.ValueModel | None) -> list[tuple[Any, list[tuple[nn.Module, str, str]]]]:
        """Where each parameter of a model built on ``meta`` is stored (read by :meth:`materialize`); before
        LoRA wraps the layers: the stored names are the bare models'."""
        from .hf_shards import WeightFiles, sources

        o = self.options
        actor_files = WeightFiles(o.model, o.flag("model"))
        load = [(actor_files, sources(actor, actor_files))]
        if reference is not None:
            load.append((actor_files, sources(reference, actor_files)))
        if critic is not None:
            critic_files = (actor_files if (o.critic or o.model) == o.model
                            else WeightFiles(o.critic, o.flag("critic")))
            load.append((critic_files, sources(critic.backbone, critic_files)))
        return load

    def _prepare(self, net: nn.Module) -> None:
        """No dropout anywhere (maker and trainer evaluate the same function); gradient checkpointing."""
        for m in net.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        if self.options.gradient_checkpointing:
            inner = net.backbone if isinstance(net, M.ValueModel) else net
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def trainer_reference(self, empty: bool) -> nn.Module | None:
        """The frozen reference a trainer holds under ``--ref-on trainers``: ``--model`` again in ``--dtype``
        (on ``meta`` when ``empty``: sharded and filled like the actor), eval mode, no gradients. None with
        makers computing ``ref_logp``, and with LoRA: there the reference is the actor's own base with its
        adapters disabled (:meth:`HFLearner.reference_logp <.hf_learner.HFLearner.reference_logp>`)."""
        o = self.options
        if o.ref_on != "trainers" or o.lora_rank:
            return None
        ref = M.empty_causal_lm(o.model, self.param_dtype) if empty else M.load_causal_lm(o.model, self.param_dtype)
        for m in ref.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return ref.eval().requires_grad_(False)

    @torch.no_grad()
    def materialize(self, model: HFActorCritic) -> None:
        """Fill the parameters of a model built by ``build(seed, "meta")``, once FSDP has sharded it
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
        if key not in self.references:
            ref = M.load_causal_lm(self.options.model, self.param_dtype)
            self.references[key] = ref.to(device).eval().requires_grad_(False)
        return self.references[key]

    # -- the maker side of a publish -----------------------------------------------------------------
    def publish_tensors(self, model: HFActorCritic) -> list[Tensor]:
        """The actor's parameters (all, or only the LoRA adapters) in named_parameters order."""
        return [t for _, t in self.publish_named(model)]

    def publish_named(self, model: HFActorCritic) -> list[tuple[str, Tensor]]:
        """:meth:`publish_tensors` with the actor's parameter names (what an engine loads by)."""
        items = list(model.actor.named_parameters())
        if self.options.lora_rank:
            items = [(n, p) for n, p in items if "lora_" in n]
            trainable = [n for n, p in model.actor.named_parameters() if p.requires_grad]
            if trainable != [n for n, _ in items] or not items:
                raise ValueError(f"LoRA mode: trainable actor parameters {trainable[:4]} are not exactly the adapters")
        return [(n, p.data) for n, p in items]

    @torch.no_grad()
    def after_publish(self, model: HFActorCritic) -> None:
        """Maker side, after new weights were written: merge LoRA (:meth:`merge_lora`); a reduced-precision
        maker copy (:meth:`maker_actor`) is rebuilt from them at the next collect."""
        model.publishes += 1  # a reduced-precision maker copy is rebuilt from these weights (maker_actor)
        self.merge_lora(model)

    def maker_actor(self, model: HFActorCritic) -> nn.Module:
        """The network a maker generates and scores with: the actor itself (fp32), or a bf16 / int8 copy
        made from its current (merged) weights, cached until the next publish."""
        o = self.options
        if o.maker_dtype == "fp32":
            return model.actor
        cached = model.__dict__.get("_maker_copy")
        if cached is not None and cached[0] == model.publishes:
            return cached[1]
        net = copy.deepcopy(model.actor)
        if o.lora_rank:
            net = net.unload()  # the base layers already hold W0 + s B A (after_publish), or W0 with B = 0
        if o.maker_dtype == "bf16":
            net = net.to(torch.bfloat16)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
                net = torch.ao.quantization.quantize_dynamic(net.cpu().float(), {nn.Linear}, dtype=torch.qint8)
        net = net.eval().requires_grad_(False)
        model.__dict__["_maker_copy"] = (model.publishes, net)  # not a submodule: never published or checkpointed
        return net

    @torch.no_grad()
    def merge_lora(self, model: HFActorCritic) -> None:
        """Maker side. Full weights: nothing to do (written in place). LoRA: every adapted layer's base
        weight becomes ``W0 + s * B @ A`` rebuilt from a pristine copy of ``W0`` taken at the first publish
        (never accumulated), and peft is told the layer is merged, so inference runs on plain matrices.
        Only makers call this; a trainer's forward stays peft's unmerged, differentiable one."""
        if not self.options.lora_rank:
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


def _is_fresh(name: str) -> bool:
    """A parameter no weights file holds: a LoRA adapter or the value head."""
    return "lora_" in name or name.startswith("critic.value_head.")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def _fresh(name: str, p: Tensor, seed: int) -> Tensor:
    from .hf_shards import fresh_value

    return fresh_value(name, tuple(p.shape), p.dtype, seed)
