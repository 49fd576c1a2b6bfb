"""Ragged fields of an experience batch: sent as each row's real span, rebuilt padded on arrival.

Some batches are padded to a fixed width (the ``hf`` workload's: prompts left-padded to ``P``, episodes
right-padded to ``E``) and the padding is most of their bytes. A :class:`Ragged` declaration (a collector's
:meth:`~hpcrl.ppo.workload.Collector.ragged`) names

* a *mask* field ``[B, W]`` whose every row is 1 on one run of consecutive columns (the row's *span*) and 0
  elsewhere, e.g. the hf attention mask: a prompt and the episode after it, contiguous;
* the fields that span carries, each ``[B, W_f]``: its column ``c`` lies over the mask's column ``c + shift``,
  and it holds ``fill`` (bit for bit) at every column outside the span.

:class:`Layout` is the payload of a schema with such declarations (:class:`~hpcrl.ppo.wire.Schema`), in order:
each declaration's spans (int64 ``start[B]`` then ``length[B]``), the fixed fields whole, each carried field's
values inside its rows' spans (rows end to end, declarations and fields in declared order), then a tail (the
stats). The mask sends no values: its span is its content. Unpacking fills each field and scatters the values
back, so the trainer gets the maker's padded tensors bit for bit; a batch that breaks its declaration is
refused by :meth:`Layout.pack` (it names the field), never sent changed.

All of it is index arithmetic valid on any device: packing reads the spans to the host once (they size the
payload), then the bytes leave the device in one copy; unpacking moves the payload to the device once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["Layout", "Ragged", "clip_spans", "row_spans", "span_index"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size views: compared bit for bit
Field = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Ragged:
    """``mask``'s rows' spans carry ``fields``: ``(name, shift, fill)`` each (see the module's docstring)."""

    mask: str
    fields: tuple[tuple[str, int, float], ...] = ()

    def names(self) -> tuple[str, ...]:
        return (self.mask, *(name for name, _, _ in self.fields))

    def to_json(self) -> dict[str, Any]:
        return {"mask": self.mask, "fields": [list(f) for f in self.fields]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Ragged":
        return cls(str(d["mask"]), tuple((str(n), int(s), float(f)) for n, s, f in d["fields"]))


# ------------------------------------------------------------------------------- the span arithmetic


def row_spans(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's ``(start, length)``: its first nonzero column (0 in an empty row) and its nonzero count."""
    nonzero = mask != 0
    length = nonzero.sum(1)
    return torch.where(length > 0, nonzero.int().argmax(1), 0), length  # argmax: the first of equal maxima


def clip_spans(start: Tensor, length: Tensor, shift: int, width: int) -> tuple[Tensor, Tensor]:
    """The mask's spans seen from a field ``width`` wide whose column ``c`` is the mask's ``c + shift``:
    ``(first column, length)`` per row, cut to the field."""
    lo = (start - shift).clamp(0, width)
    return lo, (start + length - shift).clamp(0, width) - lo


def inside(lo: Tensor, length: Tensor, width: int) -> Tensor:
    """``[B, width]``: True on each row's span."""
    col = torch.arange(width, device=lo.device)
    return (col >= lo[:, None]) & (col < (lo + length)[:, None])


def span_index(lo: Tensor, length: Tensor, width: int, total: int) -> Tensor:
    """Flat indices into a ``[B, width]`` tensor of every row's span, rows end to end; ``total`` (a host
    number: ``length.sum()``) sizes the result without reading the device."""
    # per row: its first flat index, less the values of the rows before it; then + the result's position
    rows = torch.arange(len(length), device=length.device)
    base = rows * width + lo - (torch.cumsum(length, 0) - length)
    return torch.repeat_interleave(base, length, output_size=total) + torch.arange(total, device=length.device)


def _views(start: Tensor, length: Tensor, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[Tensor, ...]]:
    """``(shift, width)`` -> the spans seen from such a field: first column, length, ``[B, width]`` inside mask."""
    out = {}
    for shift, width in dict.fromkeys(shapes):
        lo, n = clip_spans(start, length, shift, width)
        out[shift, width] = lo, n, inside(lo, n, width)
    return out


def _bits(t: Tensor) -> Tensor:
    return t.view(_BITS[t.element_size()])


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


# ------------------------------------------------------------------------------------ the payload


@dataclass(frozen=True)
class Layout:
    """The payload of ``fields`` (name, shape, dtype) with ``ragged`` declarations and ``tail`` bytes after."""

    fields: tuple[Field, ...]
    ragged: tuple[Ragged, ...]
    tail: int

    @cached_property
    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self.fields}

    @cached_property
    def fixed(self) -> tuple[str, ...]:
        """The fields sent whole, in schema order."""
        ragged = {name for r in self.ragged for name in r.names()}
        return tuple(name for name, _, _ in self.fields if name not in ragged)

    @property
    def span_nbytes(self) -> int:
        return sum(16 * self.specs[r.mask][0][0] for r in self.ragged)

    @property
    def frame_nbytes(self) -> int:
        """Bytes every payload has: spans, fixed fields, tail (all spans empty: the smallest payload)."""
        return self.span_nbytes + sum(_nbytes(*self.specs[name]) for name in self.fixed) + self.tail

    @property
    def max_nbytes(self) -> int:
        """The largest payload: every span full width."""
        return self.frame_nbytes + sum(_nbytes(*self.specs[name]) for r in self.ragged for name, _, _ in r.fields)

    def check(self, limit: int) -> None:
        """ValueError unless the declarations fit the fields: each names fields of the batch, once; each field
        ``[B, W]`` with its mask's ``B``, of a real dtype of 1, 2, 4 or 8 bytes; shifts within ``limit``,
        fills finite and exact in their field's dtype."""
        seen: set[str] = set()
        for r in self.ragged:
            for name in r.names():
                if name not in self.specs or name in seen:
                    why = "declared twice" if name in seen else "not in the batch"
                    raise ValueError(f"ragged field {name!r}: {why}")
                seen.add(name)
                shape, dtype = self.specs[name]
                if len(shape) != 2 or shape[0] != self.specs[r.mask][0][0]:
                    raise ValueError(f"ragged field {name!r}: shape {shape}, not [rows, width] with the "
                                     f"{self.specs[r.mask][0][0]} rows of its mask {r.mask!r}")
                if dtype.is_complex or dtype.itemsize not in _BITS:
                    raise ValueError(f"ragged field {name!r}: dtype {dtype} (a real dtype of 1, 2, 4 or 8 bytes)")
            for name, shift, fill in r.fields:
                dtype = self.specs[name][1]
                exact = math.isfinite(fill) and float(torch.tensor(fill, dtype=torch.float64).to(dtype)) == fill
                if abs(shift) > limit or not exact:
                    raise ValueError(f"ragged field {name!r}: shift {shift} (limit {limit}) or fill {fill} "
                                     f"(not exact in {dtype})")

    # maker side ---------------------------------------------------------------------------------
    def pack(self, batch: Mapping[str, Tensor], tail: Tensor) -> Tensor:
        """One CPU byte buffer of ``batch`` then ``tail`` (host bytes). ValueError naming the fields whose
        values break their declaration (a mask that is not one run of ones, a value outside a span that is
        not the fill): such a batch is refused, never sent changed."""
        device = batch[self.ragged[0].mask].device
        spans, broken, runs = [], [], []  # runs: (name, key of its spans, first column, length) per carried field
        for i, r in enumerate(self.ragged):
            mask = batch[r.mask]
            start, length = row_spans(mask)
            spans += [start, length]
            views = _views(start, length, [(0, mask.shape[1])] + [(s, batch[n].shape[1]) for n, s, _ in r.fields])
            broken.append((_bits(mask) != _bits(views[0, mask.shape[1]][2].to(mask.dtype))).sum())
            for name, shift, fill in r.fields:
                t, key = batch[name], (shift, batch[name].shape[1])
                fill_bits = _bits(torch.full((), fill, dtype=t.dtype, device=device))
                broken.append(((_bits(t) != fill_bits) & ~views[key][2]).sum())
                runs.append((name, (i, *key), *views[key][:2]))
        head = torch.cat([*spans, torch.stack(broken)]).cpu()  # the one read of the spans (and the check)
        host_spans = head[: head.numel() - len(broken)]
        self._refuse_broken(head[host_spans.numel() :].tolist())
        parts = [batch[name].detach().reshape(-1).view(torch.uint8) for name in self.fixed]
        index: dict[tuple[int, int, int], Tensor] = {}  # fields over the same spans share their flat index
        for (name, key, lo, n), total in zip(runs, self._totals(host_spans)):
            if key not in index:
                index[key] = span_index(lo, n, key[2], total)
            parts.append(torch.index_select(batch[name].detach().reshape(-1), 0, index[key]).view(torch.uint8))
        body = torch.cat([p.to(device) for p in parts]) if parts else torch.empty(0, dtype=torch.uint8)
        front, back = self.span_nbytes, self.span_nbytes + body.numel()
        out = torch.empty(back + tail.numel(), dtype=torch.uint8)
        out[:front] = host_spans.view(torch.uint8)
        out[front:back].copy_(body)  # the one device-to-host copy
        out[back:] = tail
        return out

    def _refuse_broken(self, counts: list[int]) -> None:
        names = [name for r in self.ragged for name in r.names()]
        bad = [f"{name} ({c} values)" for name, c in zip(names, counts) if c]
        if bad:
            raise ValueError(f"experience fields break their ragged declaration (a mask must be one run of ones per "
                             f"row; outside it each field must hold its fill): {', '.join(bad)}")

    def _split(self, spans: Tensor) -> list[tuple[Ragged, Tensor, Tensor]]:
        """Each declaration with its rows' starts and lengths (slices of ``spans``, host or device)."""
        out, at = [], 0
        for r in self.ragged:
            rows = self.specs[r.mask][0][0]
            out.append((r, spans[at : at + rows], spans[at + rows : at + 2 * rows]))
            at += 2 * rows
        return out

    def _totals(self, spans: Tensor) -> list[int]:
        """Host spans -> each carried field's value count, in payload order."""
        return [int(clip_spans(start, length, shift, self.specs[name][0][1])[1].sum())
                for r, start, length in self._split(spans) for name, shift, _ in r.fields]

    # trainer side -------------------------------------------------------------------------------
    def spans(self, buf: Tensor) -> Tensor:
        """The spans of payload ``buf`` (host int64), checked before anything is sized from them: within
        their mask's columns, and making exactly ``buf``'s size; else ValueError saying what is wrong."""
        if buf.numel() < self.frame_nbytes:
            raise ValueError(f"payload of {buf.numel()} bytes, shorter than its fixed part ({self.frame_nbytes})")
        spans = buf[: self.span_nbytes].clone().view(torch.int64)
        for r, start, length in self._split(spans):
            width = self.specs[r.mask][0][1]
            bad = (start < 0) | (start > width) | (length < 0) | (length > width - start.clamp(0, width))
            if bool(bad.any()):
                row = int(bad.int().argmax())
                raise ValueError(f"{r.mask!r} row {row}: span start {int(start[row])} length {int(length[row])}, "
                                 f"not within its {width} columns")
        items = [self.specs[name][1].itemsize for r in self.ragged for name, _, _ in r.fields]
        size = self.frame_nbytes + sum(n * k for n, k in zip(self._totals(spans), items))
        if size != buf.numel():
            raise ValueError(f"payload of {buf.numel()} bytes, its spans make {size}")
        return spans

    def unpack(self, buf: Tensor, device: torch.device | str) -> dict[str, Tensor]:
        """The padded fields of payload ``buf`` (checked by :meth:`spans`) on ``device``."""
        spans = self.spans(buf)
        totals = iter(self._totals(spans))
        dev = buf[: buf.numel() - self.tail].to(device, non_blocking=True)  # the one host-to-device copy
        out: dict[str, Tensor] = {}
        at = self.span_nbytes
        for name in self.fixed:
            shape, dtype = self.specs[name]
            # clone() first: a fresh buffer is aligned for any dtype (the packed offset may not be)
            out[name] = dev[at : at + _nbytes(shape, dtype)].clone().view(dtype).reshape(shape)
            at += _nbytes(shape, dtype)
        on_device = self._split(dev[: self.span_nbytes].clone().view(torch.int64))
        for (r, start, length), (_, _, host_length) in zip(on_device, self._split(spans)):
            index: dict[tuple[int, int], Tensor] = {}  # fields over the same spans share their flat index
            for name, shift, fill in ((r.mask, 0, 0.0), *r.fields):
                shape, dtype = self.specs[name]
                total = int(host_length.sum()) if name == r.mask else next(totals)
                if (shift, shape[1]) not in index:
                    lo, n = clip_spans(start, length, shift, shape[1])
                    index[shift, shape[1]] = span_index(lo, n, shape[1], total)
                out[name] = torch.full(shape, fill, dtype=dtype, device=device)
                if name == r.mask:  # its span is its content: ones
                    out[name].view(-1).index_fill_(0, index[0, shape[1]], 1)
                    continue
                values = dev[at : at + total * dtype.itemsize].clone().view(dtype)
                at += total * dtype.itemsize
                out[name].view(-1).index_copy_(0, index[shift, shape[1]], values)
        return out
