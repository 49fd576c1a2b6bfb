"""What detached PPO puts on the wire and in the store; owned by :mod:`hpcrl.ppo.channels`.

* the message formats: :class:`Schema` (one experience batch as one byte buffer; the fields a collector
  pads, declared ragged, as each row's span: :mod:`hpcrl.ppo.ragged`), :class:`Header`,
  :class:`Credit`, :func:`checksum`;
* every ``ppo/`` store key, and the store handshakes built on them: :class:`SchemaChannel` (a maker
  announces its batch layout before its first batch; a trainer reads it once), :class:`StatusChannel`
  (a maker's life: samples produced, dropped, done; the run finished), :func:`share_placements`
  (where every rank runs, before the planes exist) and the names of the trainers' barriers.

Nothing else in ``hpcrl.ppo`` names a store key: a key changed here changes on both sides.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hpcrl.comm import IDLE_TIMEOUT

from .ragged import Layout, Ragged

__all__ = ["ChannelError", "Credit", "Header", "Schema", "SchemaChannel", "StatusChannel", "barrier_name",
           "checksum", "share_placements"]

MAX_PAYLOAD_BYTES = 1 << 34  # 16 GiB: a schema announcing more per batch is refused, never allocated
MAX_SCHEMA_CHARS = 1 << 16  # a schema's JSON: a few fields and stats
MAX_COUNT = 1 << 62  # a produced-samples counter beyond this is not one a maker wrote

# set by the weight publisher when it gives up on broadcasts (the value: the version it fell back at)
FALLBACK_KEY = "ppo/weights/point-to-point"
FINISHED_KEY = "ppo/finished"  # set by trainer 0 before the STOP credits
RESTORE_AGREE = "ppo/ckpt-restore"  # the trainers' agreement on which checkpoint to resume


def barrier_name(name: str) -> str:
    """A barrier of the trainers (checkpoint saves)."""
    return f"ppo/{name}"


def placement_key(rank: int) -> str:
    return f"ppo/device/{rank}"


def schema_key(rank: int) -> str:
    return f"ppo/schema/{rank}"


def produced_key(m: int) -> str:
    return f"ppo/produced/{m}"


def dropped_key(m: int) -> str:
    return f"ppo/dropped/{m}"


def done_key(m: int) -> str:
    return f"ppo/done/{m}"


class ChannelError(RuntimeError):
    """A peer sent something the channel refuses (wrong size, unknown version, bad index)."""


# ------------------------------------------------------------------------------------ formats


@dataclass(frozen=True)
class Schema:
    """Names, shapes and dtypes of an experience batch and its stats: agreed once, then every batch
    is one byte buffer (no per-sample pickling). Without ``ragged`` declarations every field goes whole
    and every batch takes exactly ``nbytes``; with them (:class:`~hpcrl.ppo.ragged.Ragged`: the fields a
    collector pads to a fixed width) only each row's span travels (:class:`~hpcrl.ppo.ragged.Layout`),
    a payload takes at most ``nbytes`` and :meth:`unpack` rebuilds the padded fields bit for bit."""

    fields: tuple[tuple[str, tuple[int, ...], str], ...]
    stats: tuple[str, ...]
    ragged: tuple[Ragged, ...] = ()

    @classmethod
    def of(cls, batch: dict[str, torch.Tensor], stats: dict[str, float], ragged: Sequence[Ragged] = ()) -> "Schema":
        """The schema of ``batch``; ValueError if ``ragged`` does not fit its fields."""
        schema = cls(tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sorted(batch.items())),
                     tuple(sorted(stats)), tuple(ragged))
        if schema.ragged:
            schema.layout.check(MAX_PAYLOAD_BYTES)
        return schema

    def to_json(self) -> str:
        return json.dumps({"fields": self.fields, "stats": self.stats, "ragged": [r.to_json() for r in self.ragged]})

    @classmethod
    def from_json(cls, text: str, source: str = "the store", max_bytes: int = MAX_PAYLOAD_BYTES) -> "Schema":
        """Parse a schema a peer published (``source`` names it in errors), refusing anything malformed
        or announcing batches over ``max_bytes`` (sent, or rebuilt padded) before any buffer is sized from it."""
        if len(text) > MAX_SCHEMA_CHARS:
            raise ChannelError(f"experience schema from {source} refused: {len(text)} characters "
                               f"(limit {MAX_SCHEMA_CHARS})")
        try:
            d = json.loads(text)
            schema = cls(tuple((str(k), tuple(int(x) for x in s), str(t)) for k, s, t in d["fields"]),
                         tuple(str(x) for x in d["stats"]), tuple(Ragged.from_json(r) for r in d.get("ragged", [])))
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise ChannelError(f"experience schema from {source} refused: malformed ({type(err).__name__}: "
                               f"{err})") from None
        for name, shape, dtype in schema.fields:
            if (not isinstance(getattr(torch, dtype, None), torch.dtype) or dtype.startswith("_")
                    or len(shape) > 16 or any(not 0 <= x <= max_bytes for x in shape)):
                raise ChannelError(f"experience schema from {source}: field {name!r}: bad dtype {dtype!r} or "
                                   f"shape {shape}")
        if schema.ragged:
            try:
                schema.layout.check(max_bytes)
            except ValueError as err:
                raise ChannelError(f"experience schema from {source} refused: {err}") from None
        if max(schema.nbytes, schema.padded_nbytes) > max_bytes:
            raise ChannelError(f"experience schema from {source} refused: {schema.nbytes} bytes per batch, "
                               f"{schema.padded_nbytes} padded (limit {max_bytes})")
        return schema

    def _sizes(self) -> list[int]:
        return [math.prod(s) * torch.empty((), dtype=getattr(torch, t)).element_size() for _, s, t in self.fields]

    @cached_property
    def layout(self) -> Layout:
        """The payload of a schema with ragged fields."""
        return Layout(tuple((k, s, getattr(torch, t)) for k, s, t in self.fields), self.ragged, 8 * len(self.stats))

    @property
    def padded_nbytes(self) -> int:
        """Every field whole: a fixed schema's payload; the fields a ragged one rebuilds."""
        return sum(self._sizes()) + 8 * len(self.stats)

    @property
    def nbytes(self) -> int:
        """The largest payload (a fixed schema's every payload): with ragged fields, every span full width."""
        return self.layout.max_nbytes if self.ragged else self.padded_nbytes

    @property
    def min_nbytes(self) -> int:
        """The smallest payload: with ragged fields, every span empty."""
        return self.layout.frame_nbytes if self.ragged else self.padded_nbytes

    def pack(self, batch: dict[str, torch.Tensor], stats: dict[str, float]) -> torch.Tensor:
        """One CPU byte buffer (the host plane carries experience, whatever the maker's device)."""
        if set(batch) != {k for k, _, _ in self.fields} or set(stats) != set(self.stats):
            raise ValueError(f"experience keys {sorted(batch)} / stats {sorted(stats)} do not match the schema "
                             f"{[k for k, _, _ in self.fields]} / {list(self.stats)}")
        for name, shape, dtype in self.fields:
            t = batch[name]
            if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"experience field {name!r} is {tuple(t.shape)} {t.dtype}, schema says {shape} {dtype}")
        tail = torch.tensor([float(stats[k]) for k in self.stats], dtype=torch.float64).view(torch.uint8)
        if self.ragged:  # where the batch lives: its spans read once, its bytes copied to the host once
            return self.layout.pack(batch, tail)
        parts = [batch[k].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for k, _, _ in self.fields]
        return torch.cat([*parts, tail])

    def check_payload(self, buf: torch.Tensor, source: str) -> None:
        """ChannelError naming ``source`` unless ``buf`` is a payload of this schema: with ragged fields,
        spans within their fields' widths that make exactly its size (checked before anything is sized
        from them)."""
        try:
            if self.ragged:
                self.layout.spans(buf)
            elif buf.numel() != self.nbytes:
                raise ValueError(f"payload of {buf.numel()} bytes, the schema says {self.nbytes}")
        except ValueError as err:
            raise ChannelError(f"experience payload from {source} refused: {err}") from None

    def unpack(self, buf: torch.Tensor, device: torch.device | str = "cpu", source: str = "the wire"
               ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The batch on ``device`` (the trainer's) and its stats; a payload that is not one of this schema
        raises ChannelError naming ``source`` (:meth:`check_payload`)."""
        if self.ragged:
            try:
                out = self.layout.unpack(buf, device)  # reads the spans, checked before anything is sized from them
            except ValueError as err:
                raise ChannelError(f"experience payload from {source} refused: {err}") from None
            return {k: out[k] for k, _, _ in self.fields}, self._stats(buf)
        self.check_payload(buf, source)
        out, offset = {}, 0
        for (name, shape, dtype), size in zip(self.fields, self._sizes()):
            # clone() first: a fresh buffer is aligned for any dtype (the packed offset may not be)
            t = buf[offset : offset + size].clone().view(getattr(torch, dtype)).reshape(shape)
            out[name] = t.to(device, non_blocking=True)
            offset += size
        return out, self._stats(buf)

    def _stats(self, buf: torch.Tensor) -> dict[str, float]:
        """The stats at the end of payload ``buf``."""
        return dict(zip(self.stats, buf[buf.numel() - 8 * len(self.stats):].clone().view(torch.float64).tolist()))


@dataclass(frozen=True)
class Header:
    """Experience header: who sent it, for which credit, its sequence number, its policy version,
    its samples and its payload size."""

    maker: int
    credit: int
    seq: int
    version: int
    samples: int
    nbytes: int

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.maker, self.credit, self.seq, self.version, self.samples, self.nbytes],
                            dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        return cls(*[int(x) for x in t.tolist()])


@dataclass(frozen=True)
class Credit:
    trainer: int
    min_version: int
    credit_id: int


def checksum(flat: torch.Tensor, chunk: int = 1 << 20) -> float:
    """Order-independent exact checksum of a float tensor: its bit patterns summed as integers
    (modulo 2^52, so float64 carries it exactly). Summed in chunks: one int64 copy of a whole model
    would cost more than sending it."""
    bits = flat.detach().contiguous().reshape(-1).view(torch.int32 if flat.element_size() == 4 else torch.int16)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        total += bits[start : start + chunk].sum(dtype=torch.int64)
    return float(int(total) % (1 << 52))  # one host read (per chunk would stall a GPU stream per MiB)


# ------------------------------------------------------------------------------- store handshakes


def share_placements(store: dist.Store, rank: int, world_size: int, record: str,
                     timeout: timedelta) -> list[tuple[str, bytes]]:
    """Publish this rank's placement record, then every rank's ``(key, raw record)`` in rank order."""
    store.set(placement_key(rank), record)
    keys = [placement_key(r) for r in range(world_size)]
    store.wait(keys, timeout)
    return [(k, store.get(k)) for k in keys]


class SchemaChannel:
    """The handshake of an experience stream: a maker announces its :class:`Schema` before its first
    batch; a trainer reads it once per maker (that maker's receive thread is the first to ask).
    ``name(rank)`` names the maker in errors."""

    def __init__(self, store: dist.Store, name: Callable[[int], str] = lambda rank: f"rank {rank}") -> None:
        self.store, self._name = store, name
        self._known: dict[int, Schema] = {}

    def announce(self, rank: int, schema: Schema) -> None:
        self.store.set(schema_key(rank), schema.to_json())

    def get(self, rank: int) -> Schema:
        if rank not in self._known:
            key = schema_key(rank)
            self.store.wait([key], IDLE_TIMEOUT)  # a maker may take long to its first rollout
            self._known[rank] = Schema.from_json(self.store.get(key).decode(), source=self._name(rank))
        return self._known[rank]


class StatusChannel:
    """A maker's life in the store: the samples it handed to its sender (counted as they leave, so a
    lost maker's count outlives it), that the trainers dropped it (should it wake up from a freeze, it
    learns it and leaves), that it finished after STOP, and that the run finished (for a maker that
    missed the end). ``live``: the client of the queries a maker makes under a deadline (a liveness
    client, see :func:`hpcrl.comm.heartbeat.bounded`); default ``store``."""

    def __init__(self, store: dist.Store, live: dist.Store | None = None) -> None:
        self.store, self.live = store, store if live is None else live

    def drop(self, m: int) -> None:
        self.store.set(dropped_key(m), "1")

    def dropped(self, m: int) -> bool:
        return self.live.check([dropped_key(m)])

    def finish(self) -> None:
        self.store.set(FINISHED_KEY, "1")

    def finished(self) -> bool:
        return self.live.check([FINISHED_KEY])

    def done(self, m: int) -> None:
        self.store.set(done_key(m), "1")

    def wait_done(self, m: int, timeout_s: float) -> None:
        """Until maker ``m`` reports done (RuntimeError after ``timeout_s``)."""
        self.store.wait([done_key(m)], timedelta(seconds=timeout_s))

    def count(self, m: int, samples: int) -> None:
        self.live.add(produced_key(m), samples)

    def produced(self, m: int) -> float:
        """Maker ``m``'s final sample count (ChannelError unless it is one a maker could have written:
        an add counter cannot be signed, so its value is bounded instead)."""
        made = float(self.store.add(produced_key(m), 0))
        if not 0 <= made < MAX_COUNT:
            raise ChannelError(f"store counter {produced_key(m)!r} reads {made:.0f}, not a sample count")
        return made
