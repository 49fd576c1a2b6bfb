"""Host reads and collectives of a FastSAC run, counted per loop step (collect, store, update, log,
checkpoint, stop agreement), for tests/test_sac_host_reads.py and tests/test_sac_collectives.py.

The loop's named steps are looked up in :mod:`hpcrl.sac.loop` when ``run_loop`` calls them, so
wrapping them there attributes every count to the step that made it. Importable by spawned ranks.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hpcrl.comm.shm import SharedMemorySum
from hpcrl.sac import loop

STEPS = ("collect", "store", "update", "log", "save_reduced", "save", "stop_agreed", "preempt", "finish")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "barrier", "gather", "scatter")
_aten = torch.ops.aten


class Counts:
    """``reads[step]``: host reads; ``collectives[(step, plane)]``: collectives; ``calls[step]``: how
    often the step ran. A step nested in another (save inside preempt) counts as the inner one."""

    def __init__(self) -> None:
        self.reads: collections.Counter = collections.Counter()
        self.read_ops: collections.Counter = collections.Counter()  # (step, what) for messages
        self.collectives: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.stack: list[str] = ["outside"]
        self.planes: dict[int, str] = {}  # id(process group) -> plane name, from the Run's context

    def read(self, what: str) -> None:
        self.reads[self.stack[-1]] += 1
        self.read_ops[(self.stack[-1], what)] += 1


class _Reads(TorchDispatchMode):
    """``.item()``, ``float(t)``, ``bool(t)``, ``int(t)`` (all ``_local_scalar_dense``) and copies from
    a device to the host."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            self.counts.read("item")
        elif func in (_aten._to_copy.default, _aten.copy_.default):
            src = args[1] if func is _aten.copy_.default else args[0]
            dst = args[0].device if func is _aten.copy_.default else kwargs.get("device", src.device)
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu":
                self.counts.read("to_host")
        return func(*args, **kwargs)


class _ListReads(TorchFunctionMode):
    """``.tolist()`` and ``.numpy()``, which read memory without a dispatched op."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.counts.read(func.__name__)
        return func(*args, **(kwargs or {}))


def _in_step(counts: Counts, name: str, fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        ctx = getattr(args[0], "ctx", None) if args else None  # every step takes the Run first
        if ctx is not None and not counts.planes and ctx.is_distributed:
            counts.planes.update({id(ctx.device_plane.group): "device", id(ctx.host_plane.group): "host"})
        counts.calls[name] += 1
        counts.stack.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            counts.stack.pop()
    return wrapped


def _counted(counts: Counts, fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        group = kwargs.get("group")
        counts.collectives[(counts.stack[-1], counts.planes.get(id(group), str(group)))] += 1
        return fn(*args, **kwargs)
    return wrapped


def _counted_shm(counts: Counts, fn: Callable) -> Callable:
    """A sum through a same-host plane's shared memory (hpcrl.comm.shm): a collective too, keyed by its plane."""
    def wrapped(self, *args, **kwargs):
        counts.collectives[(counts.stack[-1], self.plane)] += 1
        return fn(self, *args, **kwargs)
    return wrapped


@contextlib.contextmanager
def counting(monkeypatch, reads: bool = True, collectives: bool = False) -> Iterator[Counts]:
    """Count in the loop's steps until the block ends (``monkeypatch``: pytest's, or a
    ``pytest.MonkeyPatch()`` in a spawned rank); collectives are keyed by plane name."""
    counts = Counts()
    for name in STEPS:
        monkeypatch.setattr(loop, name, _in_step(counts, name, getattr(loop, name)))
    if collectives:
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, _counted(counts, getattr(dist, name)))
        monkeypatch.setattr(SharedMemorySum, "sum_", _counted_shm(counts, SharedMemorySum.sum_))
    with contextlib.ExitStack() as stack:
        if reads:
            stack.enter_context(_Reads(counts))
            stack.enter_context(_ListReads(counts))
        yield counts


def train_counted(cfg, reads: bool = True, collectives: bool = False) -> dict[str, dict]:
    """``hpcrl.sac.train(cfg)`` on this rank, counted; plain dicts (they cross processes)."""
    import pytest
    import sac_workers

    from hpcrl.sac import train

    sac_workers.register_toy()
    patch = pytest.MonkeyPatch()
    try:
        with counting(patch, reads=reads, collectives=collectives) as counts:
            row = train(cfg)
    finally:
        patch.undo()
    return {"row": row, "calls": dict(counts.calls), "reads": dict(counts.reads),
            "read_ops": dict(counts.read_ops), "collectives": dict(counts.collectives)}
