"""Average gradients across ranks at every optimizer update, with one collective per GradAverager.

Call order per update::

    averager.zero_grad()            # or optimizer.zero_grad(); see "view" below
    loss.backward()
    averager.all_reduce()           # every rank, every update, same order
    optimizer.step()

Modes (all give the same numbers; exactly for power-of-two world sizes):

- ``flat``: ``ops.flatten(grads, out=buffer)`` -> one all-reduce(SUM) -> ``ops.unflatten_(buffer,
  grads, scale=1/W)``: two fused copies around the collective, grads stay where autograd put them.
- ``view``: every ``p.grad`` is a view into one persistent flat buffer, so backward accumulates
  straight into it and the all-reduce runs in place (zero copies), followed by one in-place scale
  (NCCL applies ``ReduceOp.AVG`` itself instead). Use :meth:`GradAverager.zero_grad`, or
  ``optimizer.zero_grad(set_to_none=False)``, to keep the views: ``set_to_none=True`` (torch's
  default) detaches them, and :meth:`all_reduce` then copies each fresh grad back into the buffer
  and re-attaches the view (correct, but no longer zero-copy; warned once).
- given ``grad_buffers`` (flat or view mode): every ``p.grad`` already views one of these caller-owned
  flat buffers (e.g. :class:`hpcrl.sac.flat.FlatParams`), which are averaged in place like view mode's.
- ``ddp``: the reference. :meth:`GradAverager.wrap` returns ``DistributedDataParallel(module)``, which
  reduces that module's grads during backward; :meth:`all_reduce` then only covers parameters that
  no wrapped module owns (e.g. a bare ``log_alpha``), with one flat collective. Only losses computed
  through the wrapper are averaged: evaluate the module unwrapped (``.module``) elsewhere. Without
  ``wrap()``, ddp mode reduces every parameter with the flat collective.

Overlap (``overlap=True``, flat/view modes with grads viewing a buffer): the buffer is cut into buckets
of about ``bucket_bytes`` (consecutive parameters, in reverse parameter order: backward's order), each
parameter's post-accumulate-grad hook counts its bucket down, and a full bucket's all-reduce starts
asynchronously while backward goes on; :meth:`all_reduce` starts what is left and waits for all of them
before the step. Buckets start strictly in their fixed order (a ready bucket waits for the ones before
it), so every rank issues the same collectives in the same order. The sums are elementwise, the scale
the same one multiply: the result is bitwise the non-overlapped one. On a plane with a shared-memory
segment (:mod:`hpcrl.comm.shm`) a sum is tens of microseconds on this thread: overlap is off there.

Gradients that are None on a rank count as zeros: after :meth:`all_reduce` every parameter has a
gradient (the average) on every rank, so every optimizer steps the same parameters. The collective
has the same shape on all ranks regardless. With world size 1 nothing is communicated or touched.
Parameters of several dtypes (fp32 + bf16) get one buffer, hence one collective, per dtype.
"""

from __future__ import annotations

import datetime
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist
from torch import nn

from ._pack import pack, unpack_
from .planes import Plane

__all__ = ["GradAverager", "Mode"]

Mode = Literal["flat", "view", "ddp"]
_ALIGN_BYTES = 16  # view offsets aligned so foreach/fused optimizer kernels keep vectorized loads


@dataclass
class _Bucket:
    """Parameters of one dtype and their persistent flat buffer (plus grad views in view mode)."""

    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Piece:
    """A contiguous span of a bucket's buffer covering consecutive parameters: one overlapped all-reduce."""

    params: list[nn.Parameter]
    span: torch.Tensor
    views: dict[int, torch.Tensor]
    pending: int = 0
    work: Any = None


def _cut_pieces(buckets: list[_Bucket], bucket_bytes: int) -> list[_Piece]:
    """Each bucket's parameters, last first (backward's order), cut into spans of >= ``bucket_bytes``
    (the last one smaller); a span runs from its first parameter's view to its last's, gaps included."""
    pieces = []
    for bucket in buckets:
        base = bucket.buffer.data_ptr()
        size = bucket.buffer.element_size()
        order = list(zip(bucket.params, bucket.views))[::-1]
        group: list = []
        for k, (p, v) in enumerate(order):
            group.append((p, v))
            if sum(v.numel() for _, v in group) * size >= bucket_bytes or k == len(order) - 1:
                starts = [(v.data_ptr() - base) // size for _, v in group]
                lo, hi = min(starts), max(s + v.numel() for s, (_, v) in zip(starts, group))
                pieces.append(_Piece([q for q, _ in group], bucket.buffer[lo:hi], {id(q): w for q, w in group},
                                     pending=len(group)))
                group = []
    return pieces


def _make_buckets(params: list[nn.Parameter], view: bool) -> list[_Bucket]:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    buckets = []
    for dtype, group in by_dtype.items():
        align = max(1, _ALIGN_BYTES // group[0].element_size()) if view else 1
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += -(-p.numel() // align) * align
        buffer = torch.zeros(total, dtype=dtype, device=group[0].device)
        bucket = _Bucket(group, buffer)
        if view:
            for p, off in zip(group, offsets):
                v = buffer[off : off + p.numel()].view_as(p)
                if p.grad is not None:
                    v.copy_(p.grad)  # keep a gradient computed before the GradAverager existed
                p.grad = v
                bucket.views.append(v)
        buckets.append(bucket)
    return buckets


def _given_buckets(params: list[nn.Parameter], buffers: list[torch.Tensor]) -> list[_Bucket]:
    """One bucket per caller-owned flat gradient buffer, with the grads that view it."""
    buckets = []
    for buffer in buffers:
        lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        group = [p for p in params if p.grad is not None and p.grad.dtype == buffer.dtype
                 and p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                 and lo <= p.grad.data_ptr() < hi]
        buckets.append(_Bucket(group, buffer, [p.grad for p in group]))
    covered = {id(p) for b in buckets for p in b.params}
    if len(covered) != len(params):
        missing = [tuple(p.shape) for p in params if id(p) not in covered]
        raise ValueError(f"GradAverager: parameters of shapes {missing} have no grad viewing a grad_buffers buffer")
    return buckets


class GradAverager:
    """Gradient averaging for one set of parameters (e.g. critic + log-alpha, or the actor).

    ``params``: the parameters whose grads are averaged (frozen ones, ``requires_grad=False``, are
    skipped; duplicates are dropped). ``plane``: the device plane whose ranks average (the world's
    for FastSAC, the trainers' for detached PPO; a plane of one communicates nothing).
    ``ddp_kwargs``: extra DistributedDataParallel options. ``grad_buffers``: flat gradient buffers (one
    per dtype) that every parameter's ``.grad`` views already: averaged in place, no pack or unpack.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        mode: Mode = "flat",
        *,
        plane: Plane,
        ddp_kwargs: dict[str, Any] | None = None,
        grad_buffers: Iterable[torch.Tensor] | None = None,
        overlap: bool = False,
        bucket_bytes: int = 1 << 18,
        timeout_s: float = 300.0,
    ):
        if mode not in ("flat", "view", "ddp"):
            raise ValueError(f"GradAverager mode must be 'flat', 'view' or 'ddp', not {mode!r}")
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)  # type: ignore[arg-type]
        self.params = list(unique.values())
        if not self.params:
            raise ValueError("GradAverager got no parameters that require grad")
        if len({p.device for p in self.params}) > 1:
            raise ValueError(f"GradAverager parameters span devices {sorted({str(p.device) for p in self.params})}")
        for i, p in enumerate(self.params):
            if not p.is_contiguous():
                raise ValueError(f"GradAverager parameter {i} (shape {tuple(p.shape)}) is not contiguous")
        if plane.name != "device":
            raise ValueError(f"GradAverager averages on a device plane, got the {plane}")
        if plane.active:
            plane.check(self.params, "GradAverager parameter")
        self.mode: Mode = mode
        self.plane = plane
        self.group = plane.group
        self.world_size = plane.size if plane.active else 1
        # NCCL applies the 1/W inside the collective; elsewhere SUM then one in-place scale.
        self._avg_op = self.world_size > 1 and plane.backend == "nccl"
        self._ddp_kwargs = ddp_kwargs or {}
        self._covered: set[int] = set()  # ids of parameters reduced by a DDP wrapper
        self._warned_detached = False
        if grad_buffers is not None and mode == "ddp":
            raise ValueError("GradAverager: grad_buffers are averaged in place; ddp reduces its own buckets")
        self._view = mode == "view" or grad_buffers is not None
        self._buckets = (_make_buckets(self.params, view=self._view) if grad_buffers is None
                         else _given_buckets(self.params, list(grad_buffers)))
        if overlap and not self._view:
            raise ValueError("GradAverager: overlap needs gradients viewing a flat buffer (view mode or grad_buffers)")
        # A shared-memory sum takes tens of microseconds and runs on this thread: nothing to overlap.
        self.overlap = overlap and self.world_size > 1 and plane.shm is None
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pieces: list[_Piece] = []
        if self.overlap:
            self._pieces = _cut_pieces(self._buckets, bucket_bytes)
            for i, piece in enumerate(self._pieces):
                for p in piece.params:
                    p.register_post_accumulate_grad_hook(self._ready_hook(i))

    def wrap(self, module: nn.Module) -> nn.Module:
        """``DistributedDataParallel(module)`` in ddp mode with world size > 1, else ``module``."""
        if self.mode != "ddp" or self.world_size == 1:
            return module
        ids = {id(p) for p in self.params}
        owned = {id(p) for p in module.parameters() if id(p) in ids}
        if not owned:
            raise ValueError("none of this module's parameters belong to this GradAverager")
        self._covered |= owned
        self._buckets = _make_buckets([p for p in self.params if id(p) not in self._covered], view=False)
        device = next(module.parameters()).device
        options: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None}
        if not {"broadcast_buffers", "forward_sync_buffers"} & set(self._ddp_kwargs):
            # Buffers (e.g. normalizer statistics) are reduced explicitly by the trainer; DDP's default
            # would overwrite them with rank 0's copy at every forward. torch >= 2.13 calls this
            # forward_sync_buffers (broadcast_buffers warns there); older torch has broadcast_buffers.
            # Both still broadcast them at construction, when all ranks hold the same (broadcast) buffers anyway.
            sig = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
            options["forward_sync_buffers" if "forward_sync_buffers" in sig else "broadcast_buffers"] = False
        options.update(self._ddp_kwargs)
        return nn.parallel.DistributedDataParallel(module, process_group=self.group, **options)

    def all_reduce(self) -> None:
        """Replace every gradient by its mean over the ranks of the group (one collective per dtype; with
        overlap, one per bucket, most of them already running)."""
        if self.world_size == 1:
            return
        if self.overlap:
            self._finish_overlap()
            return
        for bucket in self._buckets:
            if self._view:
                self._reduce_view(bucket)
            else:
                self._reduce_flat(bucket)

    def zero_grad(self) -> None:
        """Zero the gradients: one memset of the buffer in view mode (views re-attached), else None."""
        for bucket in self._buckets:
            if self._view:
                bucket.buffer.zero_()
                for p, v in zip(bucket.params, bucket.views):
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                        p.grad = v
        if not self._view:
            for p in self.params:
                p.grad = None

    # -- overlap

    def _ready_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            piece = self._pieces[index]
            view = piece.views[id(p)]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():  # detached by set_to_none
                view.copy_(p.grad)
                p.grad = view
            piece.pending -= 1
            self._start_ready()
        return hook

    def _start_ready(self, force: bool = False) -> None:
        """Start the buckets that are full (all, with ``force``), in order, stopping at the first that is not."""
        for piece in self._pieces:
            if piece.work is not None:
                continue
            if piece.pending > 0 and not force:
                return
            piece.work = dist.all_reduce(piece.span, op=dist.ReduceOp.AVG if self._avg_op else dist.ReduceOp.SUM,
                                         group=self.group, async_op=True)

    def _finish_overlap(self) -> None:
        for piece in self._pieces:  # gradients replaced outside backward (no hook ran): re-attach them
            for p in piece.params:
                view = piece.views[id(p)]
                if piece.work is None and p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        self._start_ready(force=True)
        for i, piece in enumerate(self._pieces):
            try:
                piece.work.wait(self._timeout)
            except Exception as e:  # gloo names no peer: say which collective and how long
                raise RuntimeError(f"GradAverager: bucket {i} of {len(self._pieces)} all-reduce did not complete "
                                   f"within {self._timeout.total_seconds():.0f} s on {self.plane} (a peer rank "
                                   f"stopped or skipped an update): {e}") from e
            piece.work = None
            piece.pending = len(piece.params)
        if not self._avg_op:
            for bucket in self._buckets:
                bucket.buffer.mul_(1.0 / self.world_size)

    def _reduce_flat(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        pack(grads, out=bucket.buffer)
        self.plane.sum_(bucket.buffer)
        unpack_(bucket.buffer, grads, scale=1.0 / self.world_size)

    def _reduce_view(self, bucket: _Bucket) -> None:
        detached = False
        for p, v in zip(bucket.params, bucket.views):
            g = p.grad
            if g is not None and g.data_ptr() == v.data_ptr():
                continue
            detached = True
            if g is None:
                v.zero_()
            else:
                v.copy_(g)
            p.grad = v
        if detached and not self._warned_detached:
            self._warned_detached = True
            warnings.warn(
                "GradAverager(view): gradients were replaced or set to None (optimizer.zero_grad() "
                "defaults to set_to_none=True), so they were copied back into the flat buffer. "
                "Call GradAverager.zero_grad() or optimizer.zero_grad(set_to_none=False) to stay zero-copy.",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._avg_op:
            dist.all_reduce(bucket.buffer, op=dist.ReduceOp.AVG, group=self.group)
        else:
            # SUM then x(1/W) is bitwise what flat mode's unflatten_ computes, for any W (AVG on gloo
            # is newer than some torch versions we support and gives no fusion on CPU anyway).
            self.plane.sum_(bucket.buffer)
            bucket.buffer.mul_(1.0 / self.world_size)
