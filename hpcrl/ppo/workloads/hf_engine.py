"""The ``hf`` workload's engines (:class:`~.engine.Engine`) and :func:`make_engine`, which picks one by
``--engine``.

:class:`HFEngine` is ``transformers``' ``generate`` (:func:`~.hf_generate.generate_by_length`) over the
maker's own actor, or its reduced-precision copy (``--maker-dtype``,
:meth:`HFModelFactory.maker_actor <.hf_factory.HFModelFactory.maker_actor>`): the prompts left-padded to
``--max-prompt-tokens``, the behaviour log-probs from one full forward over prompt + response padded to
``--max-new-tokens`` (:meth:`HFActorCritic.action_logits <.hf_factory.HFActorCritic.action_logits>`), so
the numbers are those of the padded layout the trainers score.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

from .engine import Engine, EngineCapabilities, Generation, SamplingParams
from .hf_generate import generate_by_length, left_pad, token_logp

if TYPE_CHECKING:
    from .hf_factory import HFActorCritic, HFModelFactory
    from .hf_options import HFOptions

__all__ = ["HFEngine", "make_engine"]


class HFEngine(Engine):
    """``transformers``' ``generate`` over ``model``'s actor (shared with the maker, not copied)."""

    def __init__(self, model: HFActorCritic, models: HFModelFactory, eos_id: int, pad_id: int,
                 buckets: int = 1) -> None:
        self.model, self.models = model, models
        self.eos_id, self.pad_id, self.buckets = eos_id, pad_id, buckets

    def net(self) -> nn.Module:
        """The network it generates and scores with: the actor, or its ``--maker-dtype`` copy."""
        self.model.actor.eval()
        return self.models.maker_actor(self.model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Generation:
        device = next(self.model.actor.parameters()).device
        width = max(self.model.prompt_len, max(map(len, prompts)))  # a later turn's context is longer
        ids, mask = left_pad(prompts, width, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        net = self.net()
        response, amask = generate_by_length(net, ids, mask.long(), params, self.eos_id, self.pad_id, seed,
                                             self.buckets)
        response, amask = response.to(device), amask.to(device)
        tokens, attn = torch.cat([ids, response], 1), torch.cat([mask, amask], 1)
        logp = token_logp(self.model.action_logits(tokens, attn, net, width), response, params.temperature)
        return Generation.from_padded(response, amask, logp, self.eos_id)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy each tensor into the actor's parameter of that name, unless it is that parameter's own
        storage (a maker's receiver writes the published tensors into the actor itself, and the workload's
        ``after_publish`` has merged them). When any was copied, the maker side of a publish runs here
        (LoRA merged, the reduced-precision copy re-made at the next batch)."""
        params = dict(self.model.actor.named_parameters())
        copied = False
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf engine: no actor parameter named {name!r} to load")
            p = params[name]
            if p.data_ptr() != tensor.data_ptr():
                p.data.copy_(tensor)
                copied = True
        if copied:
            self.models.after_publish(self.model)
        self.version = version

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities("hf", dtypes=("fp32", "bf16", "int8"), head_sizes=None, lora="merged")


def make_engine(options: HFOptions, model: HFActorCritic, models: HFModelFactory, eos_id: int, pad_id: int,
                device: torch.device) -> Engine:
    """The engine ``--engine`` names, for the maker on ``device``, over its ``model`` (``hf`` generates with
    the model itself, on the model's device)."""
    if options.engine == "hf":
        return HFEngine(model, models, eos_id, pad_id, options.generate_buckets)
    if options.engine == "vllm":
        from .vllm_engine import VLLMEngine  # imports vLLM: only where it is used

        return VLLMEngine(options, model, models, eos_id, device)
    raise ConfigError(f"{options.flag('engine')} {options.engine}: not available; use {options.flag('engine')} hf")
