"""Which device a rank gets: one rule for every launcher and role.

* ``cpu`` -> cpu. ``auto`` -> ``cuda`` when a GPU is visible, else cpu. ``cuda`` without a GPU is an error.
* CUDA under Slurm / torchrun / MPI: ``cuda:LOCAL_RANK``; when a task sees exactly one GPU (per-task
  binding, ``srun --gpus-per-task=1``) it is ``cuda:0``. More local ranks than GPUs is an error.
* CUDA under hpcrl's local launchers (``--nproc N``, submitit's local executor): rank ``r`` gets
  ``cuda:(r mod G)``. NCCL refuses two ranks of one communicator on one GPU, so
  :func:`check_local_gpus` rejects ``N > G`` before anything is spawned.

Pure functions of (request, launcher, local rank, GPU count): tested with a faked count.
"""

from __future__ import annotations

from typing import Literal

import torch

from .context import DistSetupError, Source

__all__ = ["DeviceRequest", "check_local_gpus", "cuda_count", "rank_device", "resolve_kind"]

DeviceRequest = Literal["auto", "cpu", "cuda"] | str  # or an explicit "cuda:K"


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_kind(request: str, count: int, flag: str = "--device") -> str:
    """``"cpu"`` or ``"cuda"`` for a request, or a DistSetupError saying what to change."""
    kind = request.split(":", 1)[0]
    if kind not in ("auto", "cpu", "cuda"):
        raise DistSetupError(f"{flag} {request!r}: expected auto, cpu, cuda or cuda:K")
    if kind == "auto":
        return "cuda" if count > 0 else "cpu"
    if kind == "cuda" and count == 0:
        raise DistSetupError(f"{flag} {request} but no GPU is visible (torch.cuda.device_count() == 0): "
                             f"use {flag} cpu, or run where CUDA is available")
    return kind


def rank_device(request: str, source: Source, local_rank: int, count: int, flag: str = "--device") -> torch.device:
    """The device of a rank (see the module docstring). ``request`` is auto / cpu / cuda / cuda:K."""
    kind = resolve_kind(request, count, flag)
    if kind == "cpu":
        return torch.device("cpu")
    if ":" in request:  # explicit index: the user decides (one process, or a wrapper that binds)
        index = int(request.split(":", 1)[1])
        if not 0 <= index < count:
            raise DistSetupError(f"{flag} {request}: only {count} GPU(s) visible (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    if count == 1:
        return torch.device("cuda", 0)  # per-task binding: each task sees its own GPU as cuda:0
    if source == "local":
        return torch.device("cuda", local_rank % count)
    if local_rank >= count:
        raise DistSetupError(
            f"LOCAL_RANK={local_rank} but only {count} GPUs are visible on this node: start at most "
            f"{count} tasks per node, or bind one GPU per task (srun --gpus-per-task=1)"
        )
    return torch.device("cuda", local_rank)


def check_local_gpus(nproc: int, request: str, count: int, flag: str = "--device", what: str = "--nproc") -> None:
    """Before spawning ``nproc`` local ranks on CUDA: NCCL needs a GPU of its own per rank."""
    if nproc > 1 and resolve_kind(request, count, flag) == "cuda" and nproc > count:
        raise DistSetupError(
            f"{what} {nproc} local ranks on CUDA but {count} GPU(s) visible: NCCL refuses two ranks of one "
            f"communicator on the same GPU. Use {what} <= {count}, or {flag} cpu"
        )
