"""Python face of ``hpcrl._C``: fused multi-tensor pack/unpack and the fused replay gather.

Every op dispatches to the compiled extension (CPU kernel, or CUDA kernel for CUDA tensors). If the
extension is not built, the pure-torch references in :mod:`hpcrl.ops.reference` run instead, after
one warning; :func:`backend` says which is active.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch  # before hpcrl._C: the extension links against libtorch, which torch loads

from . import reference
from .reference import ReplayGather

try:
    from hpcrl import _C  # type: ignore[attr-defined]
except ImportError as _err:  # the package must stay importable without a compiler
    _C = None
    _IMPORT_ERROR = str(_err)
else:
    _IMPORT_ERROR = ""

__all__ = ["backend", "with_cuda", "flatten", "unflatten_", "replay_gather", "replay_sample", "ReplayGather",
           "reference", "PREFETCH_ROWS"]

# Rows ahead whose cache lines the CPU gather requests early (0: none). benchmarks/ops/replay_sampler.py
# times 16 against 0 on cold rows, fresh every call (its JSON: prefetch16_vs_0); on a cached index set the
# hints are pure overhead.
PREFETCH_ROWS = 16

_warned = False


def backend() -> str:
    """``"extension"`` when hpcrl._C is loaded, else ``"reference"``."""
    return "extension" if _C is not None else "reference"


def with_cuda() -> bool:
    """True when hpcrl._C was built with its CUDA kernels."""
    return _C is not None and bool(_C.with_cuda)


def _fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"hpcrl._C is not built ({_IMPORT_ERROR}); using the pure-torch reference ops. "
            "Build it with: pip install --no-build-isolation -e .",
            RuntimeWarning,
            stacklevel=3,
        )


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a list of contiguous same-dtype, same-device tensors into one 1-D tensor.

    One kernel call for the whole list. ``out`` (1-D, matching dtype/device, numel = total) is
    filled in place and returned; otherwise a new tensor is allocated.
    """
    if _C is None:
        _fallback()
        return reference.flatten(tensors, out)
    if out is None and len(tensors) == 0:
        return torch.empty(0)
    return _C.flatten(list(tensors), out)


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Scatter ``flat`` back into ``tensors`` in place, multiplied by ``scale``.

    ``scale = 1 / world_size`` turns a summed all-reduce into a gradient average within the copy.
    """
    if _C is None:
        _fallback()
        return reference.unflatten_(flat, tensors, scale)
    _C.unflatten_(flat, list(tensors), float(scale))


def replay_gather(
    obs: torch.Tensor,
    action: torch.Tensor,
    reward: torch.Tensor,
    flags: torch.Tensor,
    final_ref: torch.Tensor,
    final_pool: torch.Tensor,
    head_next_obs: torch.Tensor,
    env_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    ptr: int,
    n_step: int,
    gamma: float,
    *,
    prefetch_rows: int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> ReplayGather:
    """Gather (env, slot) rows of a time-major replay shard and their n-step returns in one call.

    See :class:`hpcrl.replay.ReplayShard` for the storage layout and ``csrc/common/replay_nstep.h``
    for the window rules. ``slot_idx`` must address written slots (the shard validates). ``out``
    (obs, action, reward, next_obs, discount, n of the batch's shapes) is filled instead of allocating.
    """
    args = (obs, action, reward, flags, final_ref, final_pool, head_next_obs, env_idx, slot_idx)
    if _C is None:
        _fallback()
        return _into(reference.replay_gather(*args, int(ptr), int(n_step), float(gamma)), out)
    rows = PREFETCH_ROWS if prefetch_rows is None else int(prefetch_rows)
    return ReplayGather(*_C.replay_gather(*args, int(ptr), int(n_step), float(gamma), rows,
                                          None if out is None else list(out)))


def replay_sample(
    obs: torch.Tensor,
    action: torch.Tensor,
    reward: torch.Tensor,
    flags: torch.Tensor,
    final_ref: torch.Tensor,
    final_pool: torch.Tensor,
    head_next_obs: torch.Tensor,
    ptr: int,
    n_step: int,
    gamma: float,
    seed: int,
    offset: int,
    env_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    *,
    prefetch_rows: int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> ReplayGather:
    """Draw rows ``offset .. offset + B`` of ``seed``'s stream (B = ``env_idx.numel()``) uniformly over
    the written (env, slot) pairs and gather them, in one call: the indices come from a counter-based
    RNG inside the kernel (Philox4x32-10, ``csrc/common/replay_sample.h``), written to ``env_idx`` /
    ``slot_idx`` ([B] int64, on the storage's device). ``out`` as in :func:`replay_gather`."""
    storage = (obs, action, reward, flags, final_ref, final_pool, head_next_obs)
    if _C is None:
        _fallback()
        batch, env, slot = reference.replay_sample(*storage, int(ptr), int(n_step), float(gamma), int(seed),
                                                   int(offset), env_idx.numel())
        env_idx.copy_(env)
        slot_idx.copy_(slot)
        return _into(batch, out)
    rows = PREFETCH_ROWS if prefetch_rows is None else int(prefetch_rows)
    return ReplayGather(*_C.replay_sample(*storage, int(ptr), int(n_step), float(gamma), int(seed), int(offset),
                                          env_idx, slot_idx, rows, None if out is None else list(out)))


def _into(batch: ReplayGather, out: Sequence[torch.Tensor] | None) -> ReplayGather:
    if out is None:
        return batch
    for dst, src in zip(out, batch):
        dst.copy_(src)
    return ReplayGather(*out)
