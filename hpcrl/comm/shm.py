"""Sums over ranks that share a host, through shared memory instead of gloo's TCP loopback.

A FastSAC rank sums twice per update (critic and actor gradients) and twice per env step (normaliser
statistics, the stop flag). gloo carries each one over loopback sockets: on a 2-core VM a 120 KB sum took
0.22 ms median and 3.8 ms at p90 (scheduler wake-ups of its I/O threads), which made a second rank
slower than one. Here each rank copies its tensor into its own slot of a segment every rank maps,
publishes a round number, waits for every peer's, and sums the slots itself.

* **Same bits everywhere.** Every rank sums the same slots in the same fixed tree order (pairs, then
  pairs of pairs), so every rank holds bitwise the same result, as replicas must.
* **Two slot sets.** Round k writes set k % 2. A rank reaches round k + 2 only after every peer published
  round k + 1, which each does after it finished reading round k: no slot is overwritten while read.
  Tensors larger than a slot go in several rounds.
* **Ordered flags.** A flag is stored with release order after the slot is written and loaded with
  acquire order before the slot is read (``hpcrl._C.shm_publish`` / ``shm_wait``, which wait without
  the GIL). Without the extension, plain loads are only trusted on x86 (its stores are not reordered).
* **Nothing left behind.** Rank 0 creates the file in a scratch directory (swept if its creator dies),
  every rank maps it, and after a store barrier rank 0 unlinks it: the memory lives exactly as long as
  the last mapping, even when every rank is SIGKILLed.
* **A missing peer is named.** A peer whose process is gone is named at once; one that never arrives is
  named after the plane's timeout (a frozen one is usually named sooner by the heartbeat watch).

Only CPU planes use it (NCCL has its own shared-memory transport) and only when every rank of the plane
runs on one host and maps the same segment (checked with a token, not assumed from host names).
"""

from __future__ import annotations

import os
import platform
import secrets
import shutil
import time
import warnings
from dataclasses import replace
from datetime import timedelta

import torch

from hpcrl.core import process_state

from .barrier import barrier, hosts
from .context import DistContext
from .planes import Plane
from .scratch import make_scratch_dir

__all__ = ["SharedMemoryPeerError", "SharedMemorySum", "attach_shared_memory", "tree_sum_"]

_LINE = 64  # bytes: one flag per cache line, so a rank's store does not invalidate its peers' flags
_WAIT_SLICE_S = 0.1  # how often a waiting rank checks that the late peer's process still exists
_SEGMENT_BYTES = 64 << 20  # all slots of one plane, at most (a container's /dev/shm is often 64 MiB in all)
_SLOT_BYTES = {"host": 64 << 10, "device": 4 << 20}  # metrics and flags / gradients (a halfcheetah critic: ~3 MB)

try:
    from hpcrl import _C  # type: ignore[attr-defined]
except ImportError:  # the reference path below, on x86 only
    _C = None


class SharedMemoryPeerError(RuntimeError):
    """A peer of a shared-memory sum exited or did not arrive within the timeout; ``rank`` names it."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def tree_sum_(rows: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = sum(rows)`` in a fixed pairwise order: (r0 + r1) + (r2 + r3) + ...; exact for W equal values
    when W is a power of two. ``out`` must not alias a row."""
    while len(rows) > 2:
        rows = [torch.add(rows[i], rows[i + 1]) if i + 1 < len(rows) else rows[i] for i in range(0, len(rows), 2)]
    if len(rows) == 2:
        torch.add(rows[0], rows[1], out=out)
    else:
        out.copy_(rows[0])


class SharedMemorySum:
    """One plane's segment, mapped:
    ``[token: 64 B][flags: W x 64 B][pids: W x 8 B, padded][slots: 2 x W x slot_bytes]``.

    ``index``: this rank's position in ``ranks`` (the plane's global ranks, which errors name).
    """

    def __init__(self, segment: torch.Tensor, index: int, ranks: tuple[int, ...], slot_bytes: int, plane: str,
                 timeout: timedelta):
        w = len(ranks)
        self.index, self.ranks, self.slot_bytes, self.plane, self.timeout = index, ranks, slot_bytes, plane, timeout
        flags_at, pids_at, slots_at = _offsets(w)
        self.flags = segment[flags_at:pids_at].view(torch.int64)  # rank i's flag at [i * 8]
        self.pids = segment[pids_at : pids_at + 8 * w].view(torch.int64)
        self.slots = segment[slots_at:].view(2, w, slot_bytes)
        self.round = 0
        self.peers: list[tuple[int, str]] = []  # (pid, start) per index; pid 0: another pid namespace, not checked
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}

    @staticmethod
    def nbytes(world: int, slot_bytes: int) -> int:
        return _offsets(world)[2] + 2 * world * slot_bytes

    def sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` (contiguous, CPU) over the plane's ranks, in place. Every rank calls it in the same order."""
        flat = t.view(-1)
        per = self.slot_bytes // t.element_size()
        for lo in range(0, flat.numel(), per):
            part = flat[lo : lo + per]
            self.round += 1
            rows = self._rows(self.round & 1, part)
            rows[self.index].copy_(part)
            self._publish()
            self._wait(self.round)
            tree_sum_(rows, part)

    def _rows(self, parity: int, part: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of set ``parity``, viewed as ``part``'s dtype and length (cached: sizes repeat)."""
        key = (parity, part.dtype, part.numel())
        if key not in self._views:
            nbytes = part.numel() * part.element_size()
            self._views[key] = [row[:nbytes].view(part.dtype) for row in self.slots[parity]]
        return self._views[key]

    def _publish(self) -> None:
        if _C is not None:
            _C.shm_publish(self.flags, 8 * self.index, self.round)
        else:
            self.flags[8 * self.index] = self.round

    def _late(self, value: int, budget_s: float) -> int:
        """-1 once every flag reached ``value``, else the first index still below after ``budget_s``."""
        if _C is not None:
            return int(_C.shm_wait(self.flags, 8, len(self.ranks), value, budget_s))
        deadline = time.monotonic() + budget_s
        view = self.flags[:: 8][: len(self.ranks)]
        while True:
            behind = (view < value).nonzero()
            if behind.numel() == 0:
                return -1
            if time.monotonic() >= deadline:
                return int(behind[0])
            time.sleep(0)

    def _wait(self, value: int) -> None:
        start = time.monotonic()
        while (late := self._late(value, _WAIT_SLICE_S)) >= 0:
            waited = time.monotonic() - start
            pid, started = self.peers[late]
            rank = self.ranks[late]
            where = f"sum {value} on the {self.plane} plane (shared memory)"
            # a zombie is gone too: a launcher that has not reaped it yet (torchrun-style siblings) keeps its pid
            if pid and (not process_state.pid_alive(pid, started) or process_state.being_killed(pid)):
                raise SharedMemoryPeerError(f"rank {rank} (pid {pid}) exited while rank {self.ranks[self.index]} "
                                            f"waited for it in {where}", rank)
            if waited >= self.timeout.total_seconds():
                raise SharedMemoryPeerError(
                    f"rank {rank} (pid {pid}) did not reach {where} within {waited:.0f} s (it is frozen, stuck in "
                    "other work, or skipped a collective)", rank)


def _offsets(world: int) -> tuple[int, int, int]:
    """Byte offsets of the flags, the pids and the slots (after a 64-byte token line)."""
    flags_at = _LINE
    pids_at = flags_at + _LINE * world
    return flags_at, pids_at, pids_at + -(-8 * world // _LINE) * _LINE


def _usable() -> bool:
    # Plain loads and stores order as needed on x86 only; elsewhere the extension's atomics are required.
    return _C is not None or platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _create(nbytes: int) -> tuple[str, str]:
    """Rank 0: a zero-filled file of ``nbytes`` in tmpfs, blocks reserved now (a full /dev/shm fails here,
    with ENOSPC, rather than as SIGBUS on first touch). Returns (path, token)."""
    folder = make_scratch_dir(_shm_root())
    path = os.path.join(folder, "segment")
    token = secrets.token_hex(16)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            os.pwrite(fd, token.encode(), 0)
        finally:
            os.close(fd)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path, token


def _map(path: str, nbytes: int, token: str) -> torch.Tensor | None:
    """The segment, mapped shared, or None when this rank sees no such file or another one (a same-named
    host, a private /dev/shm): the token rank 0 wrote must be there."""
    try:
        if os.path.getsize(path) != nbytes:
            return None
        seg = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    return seg if bytes(seg[: len(token)].tolist()) == token.encode() else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_GONE = "gone"  # no process starts then: a peer that exited before the sums began is named at its first wait


def _peer(pid: int, namespace: str, own: str) -> tuple[int, str]:
    """(pid, start) of a member for :meth:`SharedMemorySum._wait`; (0, "") when its pid means nothing here
    (``namespace`` is not this process's ``own``: containers sharing a host's /dev/shm)."""
    if not namespace or namespace != own:
        return 0, ""
    return (pid, process_state.proc_start(pid)) if process_state.pid_alive(pid, "") else (pid, _GONE)


def attach_shared_memory(planes: list[Plane], ctx: DistContext) -> list[Plane]:
    """Give each CPU plane of ``planes`` (all over the same ranks) a shared-memory segment, when every member
    runs on one host and maps the same one; a plane that cannot get one keeps gloo, alike on every member.
    Collective over the planes' members (store barriers); on other ranks (their planes are inactive) a no-op."""
    store, rank = ctx.store, ctx.rank
    assert store is not None
    wanted = [p for p in planes if p.active and p.device.type == "cpu"]
    if not wanted or not _usable():
        return planes
    members = wanted[0].ranks
    if any(p.ranks != members for p in wanted):
        raise ValueError(f"attach_shared_memory: planes over different ranks: {[str(p) for p in wanted]}")
    names = hosts(ctx)
    if len({names[r] for r in members}) > 1:  # several hosts: no one segment can serve them all
        return planes
    index, w = members.index(rank), len(members)
    tag = f"shm/{'-'.join(map(str, members))}"
    made: dict[str, str] = {}
    for p in wanted:
        slot = max(_LINE, min(_SLOT_BYTES[p.name], _SEGMENT_BYTES // (2 * w)) // _LINE * _LINE)
        if index == 0:
            try:
                path, token = _create(SharedMemorySum.nbytes(w, slot))
                made[p.name] = path
                store.set(f"{tag}/{p.name}", f"{slot}|{token}|{path}")
            except OSError as err:
                warnings.warn(f"hpcrl: no shared-memory segment for the {p} ({err}); its sums use gloo")
                store.set(f"{tag}/{p.name}", "")
    mapped: dict[str, SharedMemorySum] = {}
    for p in wanted:
        value = store.get(f"{tag}/{p.name}").decode()
        if value:
            slot_text, token, path = value.split("|", 2)
            seg = _map(path, SharedMemorySum.nbytes(w, int(slot_text)), token)
            if seg is not None:
                mapped[p.name] = SharedMemorySum(seg, index, members, int(slot_text), p.name, ctx.timeout)
                mapped[p.name].pids[index] = os.getpid()
        store.set(f"{tag}/{p.name}/mapped/{rank}", f"1|{_pid_namespace()}" if p.name in mapped else "0")
    barrier(ctx, tag, ranks=members)  # every member mapped (or failed to): the creator may unlink
    for path in made.values():
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    out = []
    for p in planes:
        m = mapped.get(p.name)
        if m is not None and p in wanted:
            flags = [v.decode() for v in store.multi_get([f"{tag}/{p.name}/mapped/{r}" for r in members])]
            if all(v.startswith("1|") for v in flags):
                own = _pid_namespace()
                m.peers = [_peer(pid, v.split("|", 1)[1], own) for pid, v in zip(m.pids.tolist(), flags)]
                p = replace(p, shm=m)
        out.append(p)
    return out
