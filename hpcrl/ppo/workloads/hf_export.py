"""The ``hf`` actor as a directory ``transformers`` loads, written by streaming its tensors: what
``save_pretrained`` of the (LoRA-merged) actor writes, without building the actor.

:func:`write_pretrained` reads the actor's tensors from a :class:`TensorSource` one safetensors shard at a
time (:class:`CheckpointTensors`: a DCP checkpoint's shards, read by ``dcp.load`` into tensors allocated
for just that group of keys; :class:`StateTensors`: a state dict already in memory), merges LoRA per
module (``W0 + s B A``, :func:`lora_delta`: peft's ``get_delta_weight``), names the tensors as
``save_pretrained`` does (peft's ``base_model.model.`` / ``base_layer`` / adapters gone; tied weights and
``_keys_to_ignore_on_save`` dropped, ``revert_weight_conversion`` applied, all decided on the model's
``meta`` skeleton: nothing allocated), and writes each shard before reading the next. Files: config.json,
generation_config.json (a generating model), ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` when more than ``max_shard_size`` (huggingface_hub's split: the
shards save_pretrained would write), and the tokenizer. Alive at a time: one shard's tensors (a tensor
larger than the limit gets a file of its own, as in save_pretrained), that shard's LoRA factors and one
module's ``B A``; nothing is kept between exports. A model whose save_pretrained converts tensors (not
only renames them: ``revert_weight_conversion``) is refused with a ConfigError.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError
from hpcrl.core.diskfault import DISK_ERRNOS, DiskFault, fault_line

__all__ = ["CheckpointTensors", "DEFAULT_MAX_SHARD_SIZE", "StateTensors", "TensorSource", "generation_config",
           "lora_delta", "meta_causal_lm", "peft_scaling", "plan_export", "save_shard", "write_actor",
           "write_pretrained"]

DEFAULT_MAX_SHARD_SIZE = "2GB"
"""Per safetensors file (save_pretrained's default is 50GB): the bound on what an export holds at once."""

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_PEFT_PREFIX = "base_model.model."


class TensorSource(Protocol):
    """Named tensors read a group at a time. ``specs``: every name's (shape, dtype); ``read(names)``: those
    tensors (``owned``: fresh buffers the caller may change in place)."""

    specs: dict[str, tuple[torch.Size, torch.dtype]]
    owned: bool

    def read(self, names: list[str]) -> dict[str, Tensor]: ...


class CheckpointTensors:
    """The tensors of a DCP checkpoint directory (``dcp/``) under ``prefix`` (``model.``: the model state
    of a detached-PPO checkpoint), named without it; each :meth:`read` allocates full tensors for the names
    asked for only and fills them with ``dcp.load`` (no process group: any trainer count and strategy)."""

    owned = True

    def __init__(self, dcp_dir: str | os.PathLike, prefix: str = "model.") -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir, self.prefix = str(dcp_dir), prefix
        metadata = dcp.FileSystemReader(self.dir).read_metadata()
        self.specs = {k[len(prefix):]: (torch.Size(md.size), md.properties.dtype)
                      for k, md in metadata.state_dict_metadata.items()
                      if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}

    def read(self, names: list[str]) -> dict[str, Tensor]:
        import torch.distributed.checkpoint as dcp

        flat = {self.prefix + n: torch.empty(self.specs[n][0], dtype=self.specs[n][1]) for n in names}
        dcp.load(flat, storage_reader=dcp.FileSystemReader(self.dir), no_dist=True)
        return {n: flat.pop(self.prefix + n) for n in names}


class StateTensors:
    """A state dict in memory as a :class:`TensorSource` (the caller's tensors: never changed)."""

    owned = False

    def __init__(self, state: dict[str, Tensor]) -> None:
        self.state = state
        self.specs = {k: (v.shape, v.dtype) for k, v in state.items() if torch.is_tensor(v)}

    def read(self, names: list[str]) -> dict[str, Tensor]:
        return {n: self.state[n].detach().cpu() for n in names}


def lora_delta(a: Tensor, b: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """``s B A`` in the weight's layout: peft's ``LoraLayer.get_delta_weight`` (the makers' merge and
    ``merge_and_unload`` use it), including its fp32 product for bf16 / fp16 factors on CPU."""
    from peft.utils.other import transpose

    cast = a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)
    out = transpose((b.float() @ a.float()) if cast else (b @ a), fan_in_fan_out) * scaling
    return out.to(a.dtype) if cast else out


@dataclass
class Entry:
    """One tensor of the export: ``out`` (the name save_pretrained writes) from source tensor ``src``,
    plus ``W0 + s B A`` with ``lora = (A name, B name, fan_in_fan_out)``."""

    out: str
    src: str
    shape: torch.Size
    lora: tuple[str, str, bool] | None = None


def _bare_name(name: str, lora: bool) -> str:
    if lora:
        if not name.startswith(_PEFT_PREFIX):
            raise ConfigError(f"export: {name!r} is not a peft model's parameter (no {_PEFT_PREFIX!r} prefix)")
        name = name[len(_PEFT_PREFIX):]
        name = re.sub(r"\.base_layer\.(weight|bias)$", r".\1", name)
    return name


def plan_export(specs: dict[str, tuple[torch.Size, torch.dtype]], skeleton: nn.Module, prefix: str = "actor.",
                lora_scaling: float | None = None, lora_rank: int | None = None) -> list[Entry]:
    """What save_pretrained of the merged model would write, in its order, each from which source tensors.
    ``specs``: the source's names (those under ``prefix`` are the actor's; a peft model's when
    ``lora_scaling`` is given); ``skeleton``: the bare causal LM on ``meta`` (names, tied weights, which
    layers are ``Conv1D``)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.pytorch_utils import Conv1D

    lora = lora_scaling is not None
    names = [k for k in specs if k.startswith(prefix)]
    adapters: dict[str, dict[str, str]] = {}
    by_bare: dict[str, str] = {}
    for name in names:
        rest = name[len(prefix):]
        found = _LORA.match(rest) if lora else None
        if found is not None:
            module = _bare_name(found["module"] + ".weight", True).removesuffix(".weight")
            adapters.setdefault(module, {})[found["ab"]] = name
            continue
        if lora and "lora_" in rest:
            raise ConfigError(f"export: {rest!r}: a LoRA tensor this export does not merge (only lora_A / lora_B)")
        by_bare[_bare_name(rest, lora)] = name
    full = skeleton.state_dict()
    unknown = sorted(set(by_bare) - set(full))
    if unknown:
        raise ConfigError(f"export: checkpoint tensors {unknown[:3]} are not parameters of "
                          f"{type(skeleton).__name__}; is this checkpoint of this --hf.model?")
    kept = dict(full)
    for key in getattr(skeleton, "_keys_to_ignore_on_save", None) or ():
        kept.pop(key, None)
    kept = remove_tied_weights_from_state_dict(kept, skeleton)
    renamed = revert_weight_conversion(skeleton, kept)
    ids = {id(t): k for k, t in kept.items()}
    if any(id(t) not in ids for t in renamed.values()):
        raise ConfigError(f"export: {type(skeleton).__name__} saves converted weights (transformers' "
                          "revert_weight_conversion changes tensors, not only names): not supported")
    missing = sorted(k for k in kept if k not in by_bare)
    if missing:
        raise ConfigError(f"export: the checkpoint has no tensor for {missing[:3]} of {type(skeleton).__name__}")
    entries = []
    for out, t in renamed.items():
        bare = ids[id(t)]
        src = by_bare[bare]
        module = bare.removesuffix(".weight") if bare.endswith(".weight") else None
        pair = adapters.pop(module, None) if module is not None else None
        merge = None
        if pair is not None:
            if set(pair) != {"A", "B"}:
                raise ConfigError(f"export: {module}: lora_A and lora_B are not both in the checkpoint")
            if lora_rank is not None and specs[pair["A"]][0][0] != lora_rank:
                raise ConfigError(f"export: {pair['A']} has rank {specs[pair['A']][0][0]}, not --lora-rank {lora_rank}")
            merge = (pair["A"], pair["B"], isinstance(skeleton.get_submodule(module), Conv1D))
        entries.append(Entry(out, src, specs[src][0], merge))
    if adapters:
        raise ConfigError(f"export: LoRA adapters of {sorted(adapters)[:3]} have no saved weight to merge into")
    return entries


def write_pretrained(source: TensorSource, out: Path, skeleton: nn.Module, dtype: torch.dtype, *,
                     tokenizer: Any = None, generation_config: Any = None, lora_scaling: float | None = None,
                     lora_rank: int | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                     prefix: str = "actor.") -> Path:
    """Write the actor held by ``source`` (names under ``prefix``) into directory ``out`` as
    ``skeleton.save_pretrained`` of the merged model in ``dtype`` would, shard by shard (module docstring)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    entries = plan_export(source.specs, skeleton, prefix, lora_scaling, lora_rank)
    by_out = {e.out: e for e in entries}
    split = split_torch_state_dict_into_shards({e.out: torch.empty(e.shape, dtype=dtype, device="meta")
                                                for e in entries},
                                               filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    config = skeleton.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    for filename, outs in split.filename_to_tensors.items():
        group = [by_out[name] for name in outs]
        wanted = [e.src for e in group] + [k for e in group if e.lora for k in e.lora[:2]]
        tensors = source.read(wanted)
        shard: dict[str, Tensor] = {}
        for e in group:
            w = tensors.pop(e.src)
            if e.lora is not None:
                a, b = tensors.pop(e.lora[0]), tensors.pop(e.lora[1])
                delta = lora_delta(a, b, float(lora_scaling), e.lora[2]).to(w.dtype)
                w = w.add_(delta) if source.owned else w + delta
                del a, b, delta
            shard[e.out] = w.to(dtype).contiguous()
            del w
        save_shard(shard, out / filename)
        del shard, tensors
    if split.is_sharded:
        index = {"metadata": {"total_parameters": skeleton.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def save_shard(shard: dict[str, Tensor], path: Path) -> None:
    """``safetensors`` ``save_file``; a disk error (which safetensors raises as its own error, with the OS
    error's number in the message) as a :class:`~hpcrl.core.diskfault.DiskFault` naming ``path``."""
    from safetensors.torch import save_file

    try:
        save_file(shard, str(path), metadata={"format": "pt"})
    except Exception as err:  # noqa: BLE001  (SafetensorError: "... No space left on device (os error 28)")
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None or int(code.group(1)) not in DISK_ERRNOS:
            raise
        number = int(code.group(1))
        line = fault_line(path, OSError(number, os.strerror(number), str(path)))  # the space the write met
        path.unlink(missing_ok=True)
        raise DiskFault(line) from None


def meta_causal_lm(path: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``path`` built under ``torch.device("meta")``: every parameter and buffer on ``meta``
    (names, shapes, tied weights, layer types; nothing read or allocated). A device context is per thread:
    trainer 0's writer thread builds it while the training thread runs (a global patch would reach that)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = True  # as hf_models.load_causal_lm
    return model


def peft_scaling(lora_alpha: float, r: int, use_rslora: bool = False) -> float:
    """peft's ``LoraLayer.scaling``: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def write_actor(source: TensorSource, out_dir: str | os.PathLike, model: str, dtype: torch.dtype, *, tokenizer: Any,
                lora_config: Any = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """``out_dir/actor``: the actor of ``source`` (``--model``'s architecture in ``dtype``, LoRA of
    ``lora_config`` merged) with ``tokenizer``, written to a temporary sibling and renamed, so a reader
    never sees half a model; the model's ``meta`` skeleton names the tensors (nothing allocated, nothing
    kept)."""
    out = Path(out_dir) / "actor"
    tmp = out.with_name(f".actor.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    skeleton = meta_causal_lm(model, dtype)
    scaling = rank = None
    if lora_config is not None:
        scaling, rank = peft_scaling(lora_config.lora_alpha, lora_config.r, lora_config.use_rslora), lora_config.r
    try:
        write_pretrained(source, tmp, skeleton, dtype, tokenizer=tokenizer,
                         generation_config=generation_config(skeleton, model), lora_scaling=scaling, lora_rank=rank,
                         max_shard_size=max_shard_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".actor.old{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def generation_config(skeleton: nn.Module, model: str) -> Any:
    """What ``from_pretrained(model)`` gives the actor (its generation_config.json, else one made from the
    model config); None for a model that does not generate (save_pretrained writes none)."""
    if not skeleton.can_generate():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model)
    except OSError:
        return skeleton.generation_config
