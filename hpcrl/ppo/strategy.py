"""How the trainers hold the model: ``ddp`` or ``fsdp``.

* ``ddp``: every trainer holds the whole model, its gradients and its Adam moments; gradients are
  averaged by one flat all-reduce (:class:`hpcrl.comm.GradAverager`) before each optimizer step.
* ``fsdp``: FSDP2 ``fully_shard`` over the trainers: each of T trainers holds 1/T of every parameter,
  gradient and Adam moment (dim-0 shards); FSDP all-gathers one unit's parameters (a decoder layer,
  then the rest of the model) for its forward and backward and reduce-scatters (averages) the
  gradients itself. ``offload``: the shards, their gradients and the optimizer step live in host
  memory (``CPUOffloadPolicy``). ``bf16``: FSDP mixed precision (bf16 parameters in compute, fp32
  gradient reduction, fp32 master weights and Adam).

Under fsdp a workload that can (``capabilities().builds_on_meta``: the hf workload) builds its model
with the parameters on the ``meta`` device; after ``fully_shard`` each trainer allocates only its
shards (``to_empty``; the buffers, built for real, are kept) and the workload's ``materialize(model)``
fills them (the hf workload: each trainer reads its own dim-0 rows of the weights files). No trainer holds the whole
model at any point; other workloads are built in host memory and cut by ``fully_shard``.

Both run on the trainers' device plane (NCCL on GPUs, gloo on CPU). The rest of the trainer sees the
same three things under either strategy:

* :meth:`Strategy.snapshot` — the flat weight vector trainer 0 publishes (a collective under fsdp:
  parameters gathered bucket by bucket into trainer 0's one snapshot; no trainer ever holds a second
  full copy of the model, only the snapshot and one bucket);
* :meth:`Strategy.full_state` / :meth:`Strategy.load_full_state` — checkpoint contents as full,
  unsharded tensors, so a checkpoint is the same file under both strategies and a run may change
  strategy between jobs.

Which submodules become FSDP units is the workload's ``shard_units(model)`` (innermost first, then
the roots whose ``forward`` the learner calls); only workloads that define it can run under fsdp. On
a resume the learner's declared optimizer (:attr:`hpcrl.ppo.workload.Learner.optimizer`) says which
parameter each of the checkpoint's moments belongs to.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpcrl import ops
from hpcrl.comm import GradAverager, Plane, check_replicas_equal

from .workload import Learner, Workload

__all__ = ["Strategy", "StrategyName", "gather_flat", "local_rows", "shard_lengths"]

StrategyName = Literal["ddp", "fsdp"]


def shard_lengths(rows: int, world: int) -> list[int]:
    """Rows of dim 0 on each of ``world`` ranks, as FSDP2 shards them (``torch.chunk``: ceil-sized
    pieces, the last ones shorter or empty)."""
    chunk = math.ceil(rows / world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def local_rows(p: Tensor) -> tuple[int, int, Tensor]:
    """``(start, stop, local)``: the dim-0 rows of the full ``p`` this rank holds and the tensor holding
    them (a dim-0 sharded DTensor's local shard; a plain tensor whole)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return 0, (p.shape[0] if p.dim() else 0), p.data
    from torch.distributed.tensor import Shard

    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"a tensor placed {p.placements}, not sharded on dim 0")
    rows = shard_lengths(p.shape[0], mesh.size())
    me = mesh.get_local_rank()
    start = sum(rows[:me])
    return start, start + rows[me], p.to_local()


def _buckets(tensors: list[Tensor], bucket_numel: int) -> list[list[int]]:
    """Consecutive tensor indices, each group <= ``bucket_numel`` elements (a bigger tensor alone)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if groups[-1] and size + t.numel() > bucket_numel:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.numel()
    return [g for g in groups if g]


def gather_flat(tensors: list[Tensor], plane: Plane, bucket_numel: int, keep: bool,
                out_device: torch.device) -> Tensor | None:
    """The full tensors of dim-0 sharded DTensors ``tensors``, flattened and concatenated in order
    (what :func:`hpcrl.ops.flatten` gives for unsharded ones). Collective over ``plane`` (every member
    calls it with the same tensors); returns the vector on ``out_device`` where ``keep``, else None.

    One ``all_gather_single`` per bucket of <= ``bucket_numel`` elements: each rank sends its
    shards padded to the ceil-sized chunk, and the full rows are cut back out of the gathered buffer."""
    world = plane.size
    me = dist.get_rank(group=plane.group)
    dtype = tensors[0].dtype
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=out_device) if keep else None
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + t.numel())
    for group in _buckets(tensors, bucket_numel):
        layout = []  # (tensor index, elements per row, each rank's rows, offset in the bucket)
        offset = 0
        for i in group:
            t = tensors[i]
            if t.dim() == 0:
                raise ValueError(f"weight tensor {i} is a scalar: FSDP shards along dim 0")
            per_row = t.numel() // t.shape[0] if t.shape[0] else 0
            lengths = shard_lengths(t.shape[0], world)
            local = t.to_local()
            if local.shape[0] != lengths[me]:
                raise ValueError(f"weight tensor {i} {tuple(t.shape)}: rank {me} holds {local.shape[0]} rows, "
                                 f"a dim-0 chunk over {world} ranks has {lengths[me]}")
            layout.append((i, per_row, lengths, offset))
            offset += max(lengths) * per_row
        send = torch.zeros(offset, dtype=dtype, device=plane.device)
        for i, per_row, lengths, at in layout:
            send[at:at + lengths[me] * per_row].copy_(tensors[i].to_local().reshape(-1))
        recv = torch.empty(world * offset, dtype=dtype, device=plane.device)
        dist.all_gather_single(recv, send, group=plane.group)
        if out is None:
            continue
        for i, per_row, lengths, at in layout:
            dst = starts[i]
            for r, rows in enumerate(lengths):
                n = rows * per_row
                out[dst:dst + n].copy_(recv[r * offset + at:r * offset + at + n])
                dst += n
    return out


def fixed_mmap_threshold(nbytes: int = 64 << 10) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (``mallopt(M_MMAP_THRESHOLD)``); False where it is not
    glibc. Why: glibc raises its threshold to the size of each freed mmapped chunk (up to 32 MiB), so
    after the first step FSDP's per-unit gathered parameters and unsharded gradients come from the heap
    and stay resident once freed: a trainer's peak became the sum over the units (measured: no fall with
    N at all, benchmarks/hf/hf_memory.py) instead of its shards plus one unit. With a fixed threshold they
    stay mmapped and go back to the system when FSDP frees them. 64 KiB rather than 1 MiB: the smaller
    pieces of a unit (k / v projections, norms, activations) fragmented the heap too (24-layer
    hidden-512 Llama + LoRA, 4 trainers, gradient checkpointing: update peak +231 -> +190 MiB over the
    start; 8 layers, 2 trainers: update time 1.38-1.51 s either way)."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class ShardedGrads:
    """What a learner calls on the gradients under fsdp: FSDP has already averaged them (reduce-scatter
    in backward), so ``all_reduce`` is a no-op; ``clip_grad_norm_`` adds the shards' squared norms on the
    device plane (so shards offloaded to host memory work with an NCCL-only plane, which torch's own
    clip over DTensors does not) and scales every local shard by the same factor."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane

    def all_reduce(self) -> None:
        pass

    def clip_grad_norm_(self, params: list[Tensor], max_norm: float) -> Tensor:
        """The global gradient norm before clipping (as ``torch.nn.utils.clip_grad_norm_`` returns it)."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32, device=self.plane.device)
        for g in grads:
            local += g.detach().float().pow(2).sum().to(self.plane.device)
        if self.plane.active:
            dist.all_reduce(local, group=self.plane.group)
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.device, g.dtype))
        return total


class Strategy:
    """``ddp`` or ``fsdp`` for one trainer's model (see the module docstring). ``plane``: the trainers'
    device plane; ``keep`` (trainer 0): whether this rank keeps gathered results."""

    def __init__(self, name: StrategyName, model: nn.Module, workload: Workload, plane: Plane, device: torch.device,
                 keep: bool, offload: bool = False, dtype: str = "fp32") -> None:
        self.name, self.model, self.plane, self.device, self.keep = name, model, plane, device, keep
        self.offload = offload
        params = [p for p in model.parameters() if p.requires_grad]
        if name == "ddp":
            # replicas must start equal (workload.build_model is deterministic for a seed): checked by
            # checksums, not fixed by a broadcast, which would hold a second copy of a large model
            check_replicas_equal(model.named_parameters(), plane)
            self.grad_average: Any = GradAverager(params, "flat", plane=plane)
            return
        self._shard(model, workload, offload, dtype)
        self.grad_average = ShardedGrads(plane)  # FSDP reduce-scatters (averages) the gradients in backward

    def _shard(self, model: nn.Module, workload: Workload, offload: bool, dtype: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        units = workload.shard_units(model)  # the default refuses: a workload that runs under ddp only
        fixed_mmap_threshold()  # per-unit buffers returned when freed (see there)
        if self.plane.group is None:
            raise ValueError(f"--strategy fsdp needs the trainers' device plane as a process group ({self.plane})")
        if self.device.type == "cuda":  # the mesh's device is the current one: FSDP moves each unit there
            torch.cuda.set_device(self.device)
        self.mesh = DeviceMesh.from_group(self.plane.group, self.device.type)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload
                                    else OffloadPolicy())
        if dtype == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, **kwargs)
        if any(p.is_meta for p in model.parameters()):
            self._materialize(model, workload, offload)

    def _materialize(self, model: nn.Module, workload: Workload, offload: bool) -> None:
        """A model built on ``meta`` (:attr:`Capabilities.builds_on_meta <hpcrl.ppo.workload.Capabilities>`),
        now sharded: allocate this rank's shards (host memory with offload) and let the workload fill them
        (:meth:`Workload.materialize`). Buffers were built for real (rotary ``inv_freq``, ...) and are not
        sharded: kept as they are, not re-allocated empty."""
        buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
        model.to_empty(device=torch.device("cpu") if offload else self.device)
        for m, n, b in buffers:
            m._buffers[n] = b.to(self.device)
        workload.materialize(model)

    # -- what the trainer calls ------------------------------------------------------------------
    def snapshot(self, tensors: list[Tensor], bucket_numel: int) -> Tensor | None:
        """The flat weight vector of ``tensors`` on trainer 0 (None elsewhere); a fresh tensor that
        later updates cannot change. Under fsdp a collective of every trainer; in host memory with
        ``offload``."""
        if self.name == "ddp":
            return ops.flatten(tensors) if self.keep else None
        where = torch.device("cpu") if self.offload else self.device
        return gather_flat(tensors, self.plane, bucket_numel, self.keep, where)

    def full_state(self, state: Any) -> Any:
        """``state`` (a state dict, nested dicts / lists) with every sharded tensor gathered to a full
        host tensor, on trainer 0 (None elsewhere). Under fsdp a collective of every trainer, leaf by
        leaf in the state's order (the same on every trainer)."""
        if self.name == "ddp":
            return state if self.keep else None
        from torch.distributed.tensor import DTensor

        def walk(obj: Any) -> Any:
            if isinstance(obj, DTensor):  # through the device plane, also for shards offloaded to host memory
                full = gather_flat([obj], self.plane, obj.numel(), self.keep, torch.device("cpu"))
                return None if full is None else full.view(obj.shape)
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v) for v in obj)
            return obj

        walked = walk(state)
        return walked if self.keep else None

    @property
    def restore_device(self) -> torch.device:
        """Where a checkpoint's full tensors are loaded: host memory under fsdp (each trainer cuts its
        shards out of them; a full model and its Adam moments on every GPU would not fit)."""
        return torch.device("cpu") if self.name == "fsdp" else self.device

    def load_full_state(self, learner: Learner, model_state: dict[str, Tensor], learner_state: Any) -> None:
        """Load a checkpoint's full model and learner states (every trainer has them): each trainer
        keeps its own shards of the parameters and of the optimizer's moments."""
        if self.name == "ddp":
            self.model.load_state_dict(model_state)
            learner.load_state_dict(learner_state)
            return
        from torch.distributed.tensor import DTensor

        current = self.model.state_dict()
        self.model.load_state_dict({k: self._local(model_state[k], v) if isinstance(v, DTensor) else model_state[k]
                                    for k, v in current.items()})
        opt, saved = learner.optimizer, learner_state.get("optimizer") if isinstance(learner_state, dict) else None
        if opt is None or not isinstance(saved, dict):
            raise ValueError("--strategy fsdp: the workload's learner must declare its optimizer (Learner.optimizer) "
                             "and save its state_dict under \"optimizer\" in its own state_dict")
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, moments in saved["state"].items():  # this trainer's shard of every full moment
            param = params[int(index)]
            if isinstance(param, DTensor):
                for key, value in moments.items():
                    if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                        moments[key] = self._local(value, param)
        learner.load_state_dict(learner_state)

    def _local(self, full: Tensor, like: Any) -> Any:
        """``full`` as a DTensor placed like ``like``: this rank's dim-0 chunk, cut out locally (no
        communication) and kept on the device ``like``'s shard lives on (host memory with offload)."""
        from torch.distributed.tensor import Shard

        if tuple(like.placements) != (Shard(0),):
            raise ValueError(f"--strategy fsdp: a tensor placed {like.placements}, not sharded on dim 0")
        me = dist.get_rank(group=self.plane.group)
        rows = shard_lengths(full.shape[0], self.plane.size)
        start = sum(rows[:me])
        out = torch.empty_like(like)  # its local shard where like's is (from_local would move it to the mesh's device)
        out.to_local().copy_(full[start:start + rows[me]])
        return out
