"""Pack tensors into one flat buffer and back: the fused hpcrl.ops kernels where they apply.

The kernels take contiguous float32/float16/bfloat16 tensors; anything else (int64 counters,
float64 statistics, strided views) takes a plain torch path with the same semantics.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hpcrl import ops

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fused(flat_dtype: torch.dtype, tensors: Sequence[torch.Tensor]) -> bool:
    return flat_dtype in _FUSED_DTYPES and all(t.dtype == flat_dtype and t.is_contiguous() for t in tensors)


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate ``tensors`` (one dtype) into ``out`` or a new 1-D tensor."""
    if _fused(tensors[0].dtype if out is None else out.dtype, tensors):
        return ops.flatten(tensors, out)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat if out is None else out.copy_(flat)


@torch.no_grad()  # targets may be parameters (broadcast_ at start / after a resume)
def unpack_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (casting if needed), times ``scale``."""
    if _fused(flat.dtype, tensors):
        ops.unflatten_(flat, tensors, scale)
        return
    offset = 0
    for t in tensors:
        chunk = flat[offset : offset + t.numel()].view(t.shape)
        t.copy_(chunk if scale == 1.0 else chunk * scale)
        offset += t.numel()
