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

__all__ = ["backend", "with_cuda", "flatten", "unflatten_", "replay_gather", "ReplayGather", "reference"]

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
) -> ReplayGather:
    """Gather (env, slot) rows of a time-major replay shard and their n-step returns in one call.

    See :class:`hpcrl.replay.ReplayShard` for the storage layout and ``csrc/common/replay_nstep.h``
    for the window rules. ``slot_idx`` must address written slots (the shard validates).
    """
    args = (obs, action, reward, flags, final_ref, final_pool, head_next_obs, env_idx, slot_idx)
    if _C is None:
        _fallback()
        return reference.replay_gather(*args, int(ptr), int(n_step), float(gamma))
    return ReplayGather(*_C.replay_gather(*args, int(ptr), int(n_step), float(gamma)))
