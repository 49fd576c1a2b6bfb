"""Flat parameters: a model's parameters as views into one persistent buffer per dtype, their gradients
as views into a second one, so that an optimizer step, a Polyak update and a gradient all-reduce each
run once over a buffer instead of once per tensor (an update at small sizes is per-op overhead).

Optimizer state over a flat buffer is converted to and from the per-parameter layout with
:func:`optimizer_state_out` / :func:`optimizer_state_in`, so checkpoints keep the per-parameter format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

Tensors = list[torch.Tensor]
# Every parameter starts on a 64-byte boundary: BLAS picks its kernels by alignment, so an unaligned
# view would round differently from the same weights allocated on their own.
ALIGN_BYTES = 64


@dataclass(frozen=True)
class Reshape:
    """Two layouts of the same values: ``forward`` maps tensors shaped ``shapes_in`` to tensors shaped
    ``shapes_out``; ``inverse`` maps them back."""

    shapes_in: list[torch.Size]
    shapes_out: list[torch.Size]
    forward: Callable[[Tensors], Tensors]
    inverse: Callable[[Tensors], Tensors]


class FlatParams:
    """``params`` re-homed into one buffer per dtype (in their order); ``p.grad`` likewise when ``grads``.

    After construction every ``p`` is a view of ``buffers[p.dtype]`` and, with ``grads``, every ``p.grad``
    a view of ``grad_buffers[p.dtype]``: backward accumulates into the buffer, so keep the views (zero
    the buffer instead of setting grads to None). Values and existing gradients are kept. Each
    parameter starts at a multiple of :data:`ALIGN_BYTES`; the gaps hold zeros.
    """

    def __init__(self, params: Sequence[nn.Parameter], grads: bool = True) -> None:
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("FlatParams got the same parameter twice")
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.grad_buffers: dict[torch.dtype, torch.Tensor] = {}
        self._offsets: dict[int, int] = {}
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            group = [p for p in self.params if p.dtype == dtype]
            offsets = aligned_offsets([p.numel() for p in group], group[0].element_size())
            buffer = torch.zeros(offsets[-1], dtype=dtype, device=group[0].device)
            grad = torch.zeros_like(buffer) if grads else None
            for p, offset in zip(group, offsets):
                n = p.numel()
                self._offsets[id(p)] = offset
                buffer[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = buffer[offset : offset + n].view_as(p)
                if grad is not None:
                    view = grad[offset : offset + n].view_as(p)
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
            self.buffers[dtype] = buffer
            if grad is not None:
                self.grad_buffers[dtype] = grad

    def offset(self, param: nn.Parameter) -> int:
        """Where ``param`` starts in its dtype's buffer (elements)."""
        return self._offsets[id(param)]

    def _span(self, params: Sequence[nn.Parameter]) -> tuple[torch.dtype, int, int]:
        """(dtype, start, end) of ``params``, which must be consecutive in one buffer."""
        dtype = params[0].dtype
        group = [p for p in self.params if p.dtype == dtype]
        first = next((i for i, p in enumerate(group) if p is params[0]), None)
        if first is None or [id(p) for p in group[first : first + len(params)]] != [id(p) for p in params]:
            raise ValueError("FlatParams needs parameters consecutive in one buffer")
        start = self._offsets[id(params[0])]
        return dtype, start, self._offsets[id(params[-1])] + params[-1].numel()

    def alias(self, params: Sequence[nn.Parameter] | None = None) -> nn.Parameter:
        """One 1-D parameter viewing the range of ``params`` (default: all) in their buffer, its grad the
        same range of the grad buffer: what an optimizer or a Polyak update steps in one go."""
        params = self.params if params is None else list(params)
        dtype, start, end = self._span(params)
        alias = nn.Parameter(self.buffers[dtype][start:end], requires_grad=params[0].requires_grad)
        if dtype in self.grad_buffers:
            alias.grad = self.grad_buffers[dtype][start:end]
        return alias

    def reshape(self, params: Sequence[nn.Parameter] | None = None) -> Reshape:
        """The layout change between :meth:`alias` of ``params`` and ``params`` themselves."""
        params = self.params if params is None else list(params)
        _, start, end = self._span(params)
        shapes = [p.shape for p in params]
        offsets = [self._offsets[id(p)] - start for p in params]
        return Reshape([torch.Size([end - start])], shapes, lambda flat: split(flat[0], shapes, offsets),
                       lambda tensors: [join(tensors, offsets, end - start)])


def aligned_offsets(numels: Sequence[int], element_size: int) -> list[int]:
    """Start of each of ``numels`` in a flat buffer, aligned to :data:`ALIGN_BYTES`, then the total."""
    align = max(1, ALIGN_BYTES // element_size)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets + [total]


def split(flat: torch.Tensor, shapes: Sequence[torch.Size], offsets: Sequence[int]) -> Tensors:
    """Views of the 1-D ``flat`` shaped ``shapes`` starting at ``offsets``."""
    if offsets[-1] + shapes[-1].numel() > flat.numel():
        raise ValueError(f"split: {flat.numel()} values, the layout needs {offsets[-1] + shapes[-1].numel()}")
    return [flat[o : o + s.numel()].view(s) for o, s in zip(offsets, shapes)]


def join(tensors: Sequence[torch.Tensor], offsets: Sequence[int], total: int) -> torch.Tensor:
    """Inverse of :func:`split`: a 1-D tensor of ``total`` values, zeros between the tensors."""
    flat = tensors[0].new_zeros(total)
    for t, o in zip(tensors, offsets):
        flat[o : o + t.numel()] = t.reshape(-1)
    return flat


def optimizer_state_out(state: dict, reshapes: Sequence[Reshape]) -> dict:
    """An optimizer ``state_dict()`` over parameters in layout ``reshapes[0].shapes_in`` converted
    through each reshape's ``forward`` (e.g. flat -> per-parameter -> per-head)."""
    for r in reshapes:
        state = _convert(state, r.shapes_in, r.forward, len(r.shapes_out))
    return state


def optimizer_state_in(state: dict, reshapes: Sequence[Reshape]) -> dict:
    """Inverse of :func:`optimizer_state_out` with the same ``reshapes``."""
    for r in reversed(reshapes):
        state = _convert(state, r.shapes_out, r.inverse, len(r.shapes_in))
    return state


def _convert(sd: dict, shapes: Sequence[torch.Size], fn: Callable[[Tensors], Tensors], n_out: int) -> dict:
    """Per-element state (a tensor shaped like its parameter: exp_avg, ...) goes through ``fn``; other
    state (step) must be equal across the parameters and is copied to each output parameter."""
    if len(sd["param_groups"]) != 1:
        raise ValueError("optimizer state conversion supports one parameter group")
    group = sd["param_groups"][0]
    ids = list(group["params"])
    if len(ids) != len(shapes):
        raise ValueError(f"optimizer state has {len(ids)} parameters, the layout {len(shapes)}")
    out_group = {**group, "params": list(range(n_out))}
    if not sd["state"]:
        return {"state": {}, "param_groups": [out_group]}
    per_param = [sd["state"][i] for i in ids]  # a KeyError: some parameters were never stepped
    out: list[dict] = [{} for _ in range(n_out)]
    for key, first in per_param[0].items():
        values = [st[key] for st in per_param]
        if all(torch.is_tensor(v) and v.dim() > 0 and v.shape == s for v, s in zip(values, shapes)):
            for st, v in zip(out, fn(values)):
                st[key] = v.clone()
        else:
            if not all(torch.equal(torch.as_tensor(v), torch.as_tensor(first)) for v in values):
                raise ValueError(f"optimizer state {key!r} differs across parameters; cannot merge them")
            for st in out:
                st[key] = first.clone() if torch.is_tensor(first) else first
    return {"state": dict(enumerate(out)), "param_groups": [out_group]}
