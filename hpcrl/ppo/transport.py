"""Wire formats and point-to-point channels of detached PPO (torch.distributed, gloo or nccl).

Three channels, one tag each, so messages of one channel never match another's receive:

* credits   trainer -> maker: float64 ``[trainer_rank, min_version, credit_id]`` ("you may start one
            rollout, with weights of at least this version, and send it to me as credit_id");
* experience maker -> trainer: a fixed-size header (:class:`Header`) then ONE packed byte buffer
            holding every tensor of the batch and its rollout stats (:class:`Schema`);
* weights   trainer 0 -> maker: float64 ``[version, n_buckets, checksum, numel]`` then the flat
            parameter vector in buckets of ``bucket_numel`` elements.

Point-to-point (not one broadcast over all makers) so that a dead maker breaks only its own link.
Weights travel in their own process group (own connections), so credits and experience never
queue behind a model's worth of buckets.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TAG_CREDIT, TAG_HEADER, TAG_PAYLOAD, TAG_WEIGHTS = 11, 12, 13, 14


@dataclass(frozen=True)
class Schema:
    """Names, shapes and dtypes of an experience batch and its stats: agreed once, then every batch
    is one byte buffer of ``nbytes`` (no per-sample pickling)."""

    fields: tuple[tuple[str, tuple[int, ...], str], ...]
    stats: tuple[str, ...]

    @classmethod
    def of(cls, batch: dict[str, torch.Tensor], stats: dict[str, float]) -> "Schema":
        return cls(tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sorted(batch.items())),
                   tuple(sorted(stats)))

    def to_json(self) -> str:
        return json.dumps({"fields": self.fields, "stats": self.stats})

    @classmethod
    def from_json(cls, text: str) -> "Schema":
        d = json.loads(text)
        return cls(tuple((k, tuple(s), t) for k, s, t in d["fields"]), tuple(d["stats"]))

    def _sizes(self) -> list[int]:
        return [math.prod(s) * torch.empty((), dtype=getattr(torch, t)).element_size() for _, s, t in self.fields]

    @property
    def nbytes(self) -> int:
        return sum(self._sizes()) + 8 * len(self.stats)

    def pack(self, batch: dict[str, torch.Tensor], stats: dict[str, float]) -> torch.Tensor:
        if set(batch) != {k for k, _, _ in self.fields} or set(stats) != set(self.stats):
            raise ValueError(f"experience keys {sorted(batch)} / stats {sorted(stats)} do not match the schema "
                             f"{[k for k, _, _ in self.fields]} / {list(self.stats)}")
        parts = []
        for name, shape, dtype in self.fields:
            t = batch[name]
            if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"experience field {name!r} is {tuple(t.shape)} {t.dtype}, schema says {shape} {dtype}")
            parts.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
        parts.append(torch.tensor([float(stats[k]) for k in self.stats], dtype=torch.float64).view(torch.uint8))
        return torch.cat(parts)

    def unpack(self, buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        out, offset = {}, 0
        for (name, shape, dtype), size in zip(self.fields, self._sizes()):
            # clone() first: a fresh buffer is aligned for any dtype (the packed offset may not be)
            out[name] = buf[offset : offset + size].clone().view(getattr(torch, dtype)).reshape(shape)
            offset += size
        values = buf[offset:].clone().view(torch.float64).tolist()
        return out, dict(zip(self.stats, values))


GOODBYE = -1  # a Header.maker / weights version meaning "this stream ends here"


@dataclass(frozen=True)
class Header:
    """Experience header: who sent it, for which credit, its sequence number, its policy version."""

    maker: int
    credit: int
    seq: int
    version: int
    samples: int

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.maker, self.credit, self.seq, self.version, self.samples], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        return cls(*[int(x) for x in t.tolist()])


def checksum(flat: torch.Tensor, chunk: int = 1 << 20) -> float:
    """Order-independent exact checksum of a float tensor: its bit patterns summed as integers
    (modulo 2^52, so float64 carries it exactly). Summed in chunks: one int64 copy of a whole model
    would cost more than sending it."""
    bits = flat.detach().contiguous().reshape(-1).view(torch.int32 if flat.element_size() == 4 else torch.int16)
    total = 0
    for start in range(0, bits.numel(), chunk):
        total += int(bits[start : start + chunk].sum(dtype=torch.int64))
    return float(total % (1 << 52))


def send_weights(flat: torch.Tensor, version: int, dsts: list[int], bucket_numel: int,
                 timeout: timedelta, group=None) -> list[int]:
    """Bucketed send of ``flat`` to every rank of ``dsts`` at once; returns the ranks it failed for
    (gone, or not receiving within ``timeout``) so one dead maker never stalls the others."""
    n_buckets = max(1, math.ceil(flat.numel() / bucket_numel))
    header = torch.tensor([version, n_buckets, checksum(flat), flat.numel()], dtype=torch.float64)
    buckets = [flat[i * bucket_numel : (i + 1) * bucket_numel] for i in range(n_buckets)]
    works: dict[int, list] = {}
    failed: list[int] = []
    for dst in dsts:
        try:
            works[dst] = [dist.isend(header, dst, group=group, tag=TAG_WEIGHTS)] + [
                dist.isend(b, dst, group=group, tag=TAG_WEIGHTS) for b in buckets]
        except Exception:
            failed.append(dst)
    for dst, ws in works.items():
        try:
            for w in ws:
                w.wait(timeout)
        except Exception:
            failed.append(dst)
    return failed


def send_goodbye(dst: int, group=None) -> None:
    dist.send(torch.tensor([GOODBYE, 0, 0, 0], dtype=torch.float64), dst, group=group, tag=TAG_WEIGHTS)


def recv_weights(src: int, dtype: torch.dtype, bucket_numel: int, group=None) -> tuple[int, torch.Tensor | None]:
    """Blocking receive of one publish into a fresh (shadow) buffer; verifies the checksum.
    Returns ``(GOODBYE, None)`` when the publisher closes the stream."""
    header = torch.empty(4, dtype=torch.float64)
    dist.recv(header, src, group=group, tag=TAG_WEIGHTS)
    version, n_buckets, expected, numel = int(header[0]), int(header[1]), float(header[2]), int(header[3])
    if version == GOODBYE:
        return GOODBYE, None
    flat = torch.empty(numel, dtype=dtype)
    for i in range(n_buckets):
        dist.recv(flat[i * bucket_numel : (i + 1) * bucket_numel], src, group=group, tag=TAG_WEIGHTS)
    if checksum(flat) != expected:
        raise RuntimeError(f"weights v{version} from rank {src}: checksum mismatch (corrupted transfer)")
    return version, flat
