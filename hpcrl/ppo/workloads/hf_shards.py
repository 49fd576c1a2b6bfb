"""Load a transformers model shard by shard (``--strategy fsdp``): build it with its parameters on the
``meta`` device, let FSDP2 shard the empty model, then fill each trainer's dim-0 rows straight from the
weights files. No trainer ever holds the full model: peak host memory is its shards plus one slice.

Why every rank reads its own slices (as ``safe_open(...).get_slice`` would, with plain reads) rather than rank 0 reading the whole
state dict and broadcasting it (``set_model_state_dict(..., broadcast_from_rank0=True)``): rank 0 would
hold the full model (the point of the exercise is that none does), the broadcast sends N-1 model copies
over the trainers' plane, and every rank waits on one reader. With slices, each rank reads only its
bytes (only those: no memory map of the whole file), no collective is needed, and the
result is bit-for-bit the stored values converted to the parameter dtype, as ``from_pretrained`` gives.

* :func:`params_on_meta` — parameters on ``meta``, buffers real (as ``accelerate.init_empty_weights``
  with ``include_buffers=False``): non-persistent buffers such as rotary ``inv_freq`` are computed by
  the modules' own constructors / transformers' ``_init_weights``, not left empty;
* :class:`WeightFiles` — where each stored tensor lives (``model.safetensors``, a sharded index, or a
  ``pytorch_model.bin`` memory-mapped) and :meth:`WeightFiles.rows` to read rows of one
  (:class:`SafetensorsRows`: plain reads of exactly those bytes, no memory map);
* :func:`sources` — which stored key fills each parameter of a bare transformers model (the causal LM's
  own names, or a trunk's with the ``base_model_prefix`` added or removed; tied parameters once);
* :func:`fresh_value` — the one deterministic init of the parameters no file holds (LoRA adapters,
  the value head): the same values under ddp and fsdp and on every trainer, from the seed and the name.
"""

from __future__ import annotations

import json
import math
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

__all__ = ["WeightFiles", "fresh_value", "params_on_meta", "sources"]

SAFE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on ``meta`` (each allocated then dropped at once,
    never initialised) and their buffers on the host, computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _resolve(path: str, name: str) -> Path | None:
    """``name`` in the model directory ``path``, or in the hub cache for a hub id (never downloads)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    try:
        from transformers.utils import cached_file

        found = cached_file(path, name, local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return Path(found) if found else None


class WeightFiles:
    """The stored tensors of one model directory (or cached hub id), read row range by row range."""

    def __init__(self, path: str, flag: str = "--model") -> None:
        self.path = path
        self._where: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        for single, index in ((SAFE, SAFE_INDEX), (BIN, BIN_INDEX)):
            if (file := _resolve(path, single)) is not None:
                self._where = {k: file for k in self._keys(file)}
                break
            if (file := _resolve(path, index)) is not None:
                weight_map = json.loads(file.read_text())["weight_map"]
                shards = {shard: _resolve(path, shard) for shard in set(weight_map.values())}
                lost = sorted(s for s, p in shards.items() if p is None)
                if lost:
                    raise ConfigError(f"{flag} {path}: shard {lost[0]} of {index} is missing; save the model again")
                self._where = {k: shards[s] for k, s in weight_map.items()}  # type: ignore[misc]
                break
        else:
            raise ConfigError(f"{flag} {path}: no weights file ({SAFE} or {BIN}, or a sharded index) to load the "
                              "trainers' shards from; pass the directory save_pretrained wrote")

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            if file.suffix == ".safetensors":
                self._open[file] = SafetensorsRows(file)
            else:  # memory-mapped: slicing pages in only the rows read
                self._open[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        return self._open[file]

    def _keys(self, file: Path) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of dim 0 of the stored tensor ``key`` (a 0-dim tensor whole), as stored."""
        handle = self._handle(self._where[key])
        if isinstance(handle, dict):
            t = handle[key]
            return t.clone() if t.dim() == 0 else t[start:stop].clone()
        return handle.rows(key, start, stop)

    def close(self) -> None:
        for handle in self._open.values():
            if isinstance(handle, SafetensorsRows):
                handle.close()
        self._open.clear()  # mmapped bin files unmap when dropped


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class SafetensorsRows:
    """One ``.safetensors`` file read row range by row range with plain reads (``readinto`` of exactly
    those bytes): no memory map, so neither the file's pages nor its size count against this process
    (a mapping of the whole file would, under RLIMIT_DATA / RLIMIT_AS). The format: an 8-byte
    little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, the data."""

    def __init__(self, file: Path) -> None:
        self.file = open(file, "rb")
        n = int.from_bytes(self.file.read(8), "little")
        self.header = {k: v for k, v in json.loads(self.file.read(n)).items() if k != "__metadata__"}
        self.base = 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        meta = self.header[key]
        dtype, shape = _ST_DTYPES[meta["dtype"]], list(meta["shape"])
        begin, _ = meta["data_offsets"]
        if not shape:
            start, stop = 0, 1
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size() if shape else \
            torch.empty((), dtype=dtype).element_size()
        out = torch.empty([stop - start, *shape[1:]] if shape else [], dtype=dtype)
        if out.numel():
            self.file.seek(self.base + begin + start * row_bytes)
            self.file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
        return out

    def close(self) -> None:
        self.file.close()


def sources(net: nn.Module, files: WeightFiles) -> list[tuple[nn.Module, str, str]]:
    """``(module, attribute, stored key)`` for every distinct parameter of the bare transformers model
    ``net``: its own name, else with ``net.base_model_prefix`` added (a trunk loaded from a causal-LM
    checkpoint) or removed. A tied parameter (``lm_head.weight`` is ``embed_tokens.weight``) appears
    once, under whichever of its names is stored. A parameter no file holds is a :class:`ConfigError`."""
    prefix = getattr(net, "base_model_prefix", "") or ""
    names: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mod_name, module in net.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                full = f"{mod_name}.{attr}" if mod_name else attr
                names.setdefault(id(p), []).append((full, module, attr))
    out, missing = [], []
    for entries in names.values():
        found = None
        for full, module, attr in entries:
            for key in (full, f"{prefix}.{full}" if prefix else full, full.removeprefix(f"{prefix}.")):
                if key in files:
                    found = (module, attr, key)
                    break
            if found:
                break
        if found is None:
            missing.append(entries[0][0])
        else:
            out.append(found)
    if missing:
        raise ConfigError(f"--model {files.path}: the weights files hold no {missing[0]} ({len(missing)} parameter(s) "
                          "missing); the sharded load needs every weight stored: re-save the model, or use "
                          "--strategy ddp")
    return out


def fresh_value(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    """The initial value of a parameter no weights file holds, from ``seed`` and its ``name`` alone
    (so every trainer, under either strategy, makes the same): LoRA ``lora_A`` as peft inits it
    (Kaiming-uniform, a = sqrt(5)) from a generator seeded by (seed, name); ``lora_B``, the value head
    and anything else zero (the adapted model starts as the pretrained one, the critic at 0)."""
    out = torch.zeros(shape, dtype=torch.float32)
    if "lora_A" in name.split(".") or ".lora_A." in f".{name}.":
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
        fan_in = shape[1] if len(shape) > 1 else shape[0]
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
        out.uniform_(-bound, bound, generator=g)
    return out.to(dtype)
