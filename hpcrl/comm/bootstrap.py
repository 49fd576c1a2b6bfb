"""The one bootstrap every entry point calls: launcher detection -> device -> store -> named
barrier -> default group -> the two planes (:mod:`hpcrl.comm.planes`).

The rendezvous store is created here (not by ``init_process_group``) so that a missing peer is
caught by :func:`hpcrl.comm.barrier`, which names it, before gloo/NCCL start their opaque
full-mesh connect. ``ctx.store`` is a :class:`hpcrl.comm.secret.SignedStore`: values signed with the
job secret, every rank proving it at the init barrier (see ``docs/trust.md``).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Sequence
import warnings
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from .barrier import barrier, register_host, unverified_host_of
from .context import DistContext, DistSetupError, Source
from .devices import cuda_count, rank_device
from .env import LaunchInfo, detect_launch
from .heartbeat import PeerWatch, Watcher, describe, liveness_store
from .native_log import terminal_fd
from .planes import STRICT_BACKEND, Plane, register_strict_backend, strict_planes
from .shm import SharedMemoryPeerError, attach_shared_memory
from .secret import JOIN_KEY, SignedStore, UntrustedKeyError, check_join, load_secret, new_secret, no_secret_policy
from .spawn_child import record_peer_lost

__all__ = ["init_distributed", "shutdown", "current", "explain_failure", "watch_peers", "unwatch_peers"]

DEFAULT_TIMEOUT_S = 600.0

_active: DistContext | None = None
_watch: PeerWatch | None = None


def _tcp_store(addr: str, port: int, info: LaunchInfo, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    try:
        # wait_for_workers=False: the named barrier below does the waiting, with a better error.
        return dist.TCPStore(addr, port, info.world_size, is_master, timeout, wait_for_workers=False)
    except RuntimeError as err:
        if is_master:
            raise DistSetupError(
                f"rank 0 ({info.hostname}) could not host the rendezvous store on port {port}: {err}. "
                "Is the port taken (another job on this node)? Set MASTER_PORT to a free port."
            ) from err
        raise DistSetupError(
            f"rank {info.rank} ({info.hostname}, via {info.source}) could not reach the rendezvous store "
            f"at {addr}:{port} within {timeout.total_seconds():g} s: {err}. Is rank 0 running, does "
            f"{addr} resolve from this host, and do MASTER_ADDR / MASTER_PORT agree on every rank?"
        ) from err


def _mpi_store(info: LaunchInfo, timeout: timedelta, secret: bytes | None) -> tuple[dist.TCPStore, bytes]:
    """Rank 0 opens the store on a free port and broadcasts its address over MPI, and the job secret:
    MPI's own channel is the launcher's, so MPI ranks need no secret from the environment."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    payload: tuple[str, int, str, bytes] | None = None
    store = None
    if info.rank == 0:
        addr = os.environ.get("MASTER_ADDR") or socket.gethostname()
        port = int(os.environ.get("MASTER_PORT", "0"))  # 0: the OS picks a free port, no race
        try:
            store = _tcp_store(addr, port, info, True, timeout)
            payload = (addr, store.port, "", secret or new_secret().encode())
        except DistSetupError as err:
            payload = ("", 0, str(err), b"")  # tell the others instead of leaving them in bcast
    addr, port, error, job_secret = comm.bcast(payload, root=0)
    if error:
        raise DistSetupError(error if info.rank == 0 else f"rank 0 failed to open the store: {error}")
    return (store if store is not None else _tcp_store(addr, port, info, False, timeout)), job_secret


_MAX_DEVICE_VALUE = 512  # "1|host|uuid": a longer value is not one a rank wrote


def _devices(store: SignedStore, world: int) -> list[tuple[bool, str]]:
    """Every rank's (is CUDA, "host/uuid") as published before the init barrier, bounds-checked."""
    keys = [f"device/{r}" for r in range(world)]
    out = []
    for key, raw in zip(keys, store.multi_get(keys)):
        parts = raw[:_MAX_DEVICE_VALUE + 1].decode(errors="replace").split("|")
        if len(raw) > _MAX_DEVICE_VALUE or len(parts) != 3 or parts[0] not in ("0", "1"):
            raise DistSetupError(f"store key {key!r}: malformed device record {raw[:80]!r} (expected "
                                 "'0|host|' or '1|host|gpu-uuid'); is another program using this rendezvous port?")
        out.append((parts[0] == "1", f"{parts[1]}/{parts[2]}"))
    return out


def _refuse_shared_gpus(ctx: DistContext, devices: list[tuple[bool, str]], dev: torch.device) -> None:
    """Two ranks of one NCCL communicator on one physical GPU (told apart by UUID: with one GPU per task
    every task says cuda:0) is refused by NCCL with an opaque error; every rank raises a clear one here.
    Every rank sees the same list (published before the init barrier), so all reach the same verdict."""
    gpus = [gpu for _, gpu in devices]
    if len(set(gpus)) < len(gpus):
        shared = gpus.count(gpus[ctx.rank]) > 1
        where = f"this rank's GPU ({dev} on {ctx.hostname}) is" if shared else "a GPU of this job is"
        raise DistSetupError(f"rank {ctx.rank}: {where} used by two ranks; NCCL needs one GPU per rank: bind one "
                             "GPU per task (srun --gpus-per-task=1), start at most one task per GPU, or use --device cpu")


def init_distributed(
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    device: str = "auto",
    source: Source | None = None,
    device_flag: str = "--device",
    world_device_plane: bool = True,
    shared_memory: bool = True,
) -> DistContext:
    """Join the job as its launcher describes it and return this rank's :class:`DistContext`.

    Precedence: torchrun variables -> Slurm task variables -> MPI (mpi4py) -> single process; see
    :func:`hpcrl.comm.env.detect_launch` (``source`` forces one). ``device`` (auto / cpu / cuda /
    cuda:K) resolves by :func:`hpcrl.comm.devices.rank_device` and is made current; ``device_flag``
    names the option in errors. The device plane's ``backend`` defaults to ``nccl`` when every rank's
    device is CUDA, else ``gloo`` (agreed through the store, so a world that mixes CPU and GPU ranks
    gets one answer); the host plane is always gloo. ``timeout_s`` bounds the rendezvous, the start
    barrier and every collective. ``world_device_plane=False``: the ranks share no device plane
    (detached PPO: each role makes its own, and a trainer and a maker may share a GPU, which an NCCL
    world would refuse), so the world gets gloo only and ``ctx.device_plane`` is a CPU gloo plane.
    ``shared_memory``: when every rank runs on one host, the world's CPU planes sum through a shared-memory
    segment (:mod:`hpcrl.comm.shm`) instead of gloo; False keeps gloo for everything.
    World size 1 creates no process group. Calling it again returns the active context.
    """
    global _active
    if _active is not None:
        return _active
    info = detect_launch(source=source)
    dev = rank_device(device, info.source, info.local_rank, cuda_count(), device_flag)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    if info.world_size == 1:
        _active = DistContext(0, 1, info.local_rank, dev, None, False, info.source, timeout, info.hostname,
                              Plane.local("host"), Plane.local("device", dev))
        return _active

    base, store = _rendezvous(info, timeout)
    probe = _join(info, dev, store, timeout)
    _active = _init_planes(info, dev, backend, world_device_plane, base, store, probe)
    if shared_memory:
        host_plane, device_plane = attach_shared_memory([_active.host_plane, _active.device_plane], _active)
        _active = replace(_active, host_plane=host_plane, device_plane=device_plane)
    return _active


def _rendezvous(info: LaunchInfo, timeout: timedelta) -> tuple[dist.PrefixStore, SignedStore]:
    """The job's store: (this attempt's namespace of the raw store, hpcrl's signed view of it)."""
    secret = load_secret()
    if info.source == "mpi":
        raw, secret = _mpi_store(info, timeout, secret)
    else:
        if secret is None:
            no_secret_policy(os.environ, info.rank, info.source)
        assert info.master_addr is not None and info.master_port is not None
        is_master = info.rank == 0 and not info.store_hosted_elsewhere
        raw = _tcp_store(info.master_addr, info.master_port, info, is_master, timeout)
    # Keys of an earlier torchrun attempt may still sit in the launcher's store: namespace by attempt.
    base = dist.PrefixStore(f"attempt{info.restart}", raw)
    # The attempt and world size enter every signature: a value cannot be replayed into another attempt.
    store = SignedStore(dist.PrefixStore("hpcrl", base), secret, f"attempt{info.restart}/world{info.world_size}")
    return base, store


def _join(info: LaunchInfo, dev: torch.device, store: SignedStore, timeout: timedelta) -> DistContext:
    """Publish this rank (join proof, host, device) and pass the init barrier; returns the store-only
    context the barrier ran on."""
    probe = DistContext(info.rank, info.world_size, info.local_rank, dev, None, True, info.source, timeout,
                        info.hostname, store=store)  # type: ignore[arg-type]
    store.set(JOIN_KEY.format(rank=info.rank), "hmac-sha256" if store.signed else "none")
    register_host(probe)
    uuid = torch.cuda.get_device_properties(dev).uuid if dev.type == "cuda" else ""
    store.set(f"device/{info.rank}", f"{int(dev.type == 'cuda')}|{info.hostname}|{uuid}")
    barrier(probe, "init")  # a missing peer is named here, not reported as a gloo connect timeout
    check_join(store, info.rank, info.world_size, lambda r: f"rank {r}" + (f" ({h})" if (h := unverified_host_of(probe, r)) else ""))
    return probe


def _init_planes(info: LaunchInfo, dev: torch.device, backend: str | None, world_device_plane: bool,
                 base: dist.PrefixStore, store: SignedStore, probe: DistContext) -> DistContext:
    """The default group and the two planes, the device plane's backend agreed from every rank's device."""
    timeout = probe.timeout
    devices = _devices(store, info.world_size)
    all_cuda = world_device_plane and all(cuda for cuda, _ in devices)
    if all_cuda:
        _refuse_shared_gpus(probe, devices, dev)
    backend = backend or ("nccl" if all_cuda else "gloo")
    # A world mixing CPU and GPU ranks (detached PPO) gets a CPU gloo device plane; its roles make their own.
    plane_device = dev if backend == "nccl" or all_cuda else torch.device("cpu")
    strict = strict_planes()
    if strict:
        register_strict_backend()
    default_backend = STRICT_BACKEND if strict else backend
    dist.init_process_group(
        default_backend,
        store=dist.PrefixStore("default_pg", base),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        device_id=dev if default_backend == "nccl" else None,
    )
    ranks = tuple(range(info.world_size))
    host_plane = Plane("host", torch.device("cpu"), ranks, dist.new_group(timeout=timeout, backend="gloo"), "gloo")
    device_group = dist.new_group(timeout=timeout, backend=backend) if strict else dist.group.WORLD
    device_plane = Plane("device", plane_device, ranks, device_group, backend)
    return DistContext(info.rank, info.world_size, info.local_rank, dev, backend, True, info.source, timeout,
                       info.hostname, host_plane, device_plane, store=store,  # type: ignore[arg-type]
                       barrier_generations=probe.barrier_generations)


def current() -> DistContext | None:
    """The context returned by the last :func:`init_distributed`, or None."""
    return _active


def _say(line: str) -> None:
    os.write(terminal_fd(), (line + "\n").encode(errors="replace"))  # unbuffered: the process ends right after


def watch_peers(timeout_s: float, ranks: Sequence[int] | None = None, role: str = "", beat: bool = True) -> None:
    """Beat, and watch every other rank of the active job (or ``ranks``, named as ``role``; ``beat=False``:
    the caller beats already) (:class:`hpcrl.comm.heartbeat.PeerWatch`): a rank silent for ``timeout_s``
    is named in one line and this process exits 1, even from inside a collective. :func:`shutdown` ends
    the watch (rank 0 only after its peers left: it waits for them meanwhile)."""
    global _watch
    if _active is None or not _active.is_distributed or _watch is not None:
        return
    _watch = PeerWatch(_active, timeout_s, say=_say, record=record_peer_lost,
                       ranks=None if ranks is None else list(ranks), role=role, beat=beat)


def explain_failure(err: BaseException) -> None:
    """``err`` ended the run: when torch.distributed raised it (a collective or store call failed, as when a
    peer or the store host vanished mid-call) or a shared-memory sum lost a peer, and peers are watched, let
    the watch name the lost peer (it ends the process with that line, exit 1); return when it finds none
    within the heartbeat timeout."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    lost = isinstance(err, SharedMemoryPeerError) or f"{os.sep}torch{os.sep}distributed{os.sep}" in where
    if _watch is not None and lost:
        _watch.await_verdict()


def unwatch_peers(done: bool = False) -> None:
    """End the watch; ``done``: this rank finished (peers take its silence for an exit, not a freeze)."""
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        watch.close(done)


def shutdown(timeout_s: float | None = None, gone: Sequence[int] = (), expendable: Sequence[int] = (),
             heartbeat_timeout_s: float | None = None) -> list[int]:
    """Leave the job: destroy the process group. Safe to call when nothing was initialized.

    Rank 0 first waits up to ``timeout_s`` (default: the context's timeout) for every other rank
    to reach shutdown, because it usually hosts the store and leaving first would pull it from
    under peers still using it (NCCL creates communicators lazily through it). On an error path
    pass a short ``timeout_s``; ranks known to be ``gone`` (detached PPO's lost makers) are not waited for,
    nor is an ``expendable`` rank whose heartbeat (:class:`~hpcrl.comm.heartbeat.Heartbeat`, kept beating
    through this call) stalls for ``heartbeat_timeout_s`` before it arrives: a maker frozen after its last
    sample is lost to nobody. Returns the ranks rank 0 stopped waiting for that way.
    """
    global _active
    ctx, _active = _active, None
    if ctx is None or not ctx.is_distributed:
        return []
    store = ctx.store
    assert store is not None
    if ctx.rank != 0:  # rank 0 keeps watching while it waits for the others below
        unwatch_peers(done=True)
    dropped: list[int] = []
    try:
        store.set(f"exit/{ctx.rank}", "1")
        if ctx.rank == 0:
            timeout = ctx.timeout if timeout_s is None else timedelta(seconds=timeout_s)
            waited = [r for r in range(ctx.world_size) if r not in set(gone)]
            watched = [r for r in expendable if r in waited] if heartbeat_timeout_s else []
            if watched:
                dropped = _await_exits(store, waited, watched, timeout, heartbeat_timeout_s)
            else:
                store.wait([f"exit/{r}" for r in waited], timeout)
    except UntrustedKeyError as err:  # an exit key an impostor wrote: do not take it as the rank's exit
        warnings.warn(f"hpcrl.comm.shutdown on rank {ctx.rank}: {err}")
    except RuntimeError as err:
        try:
            missing = [r for r in range(ctx.world_size) if not store.check([f"exit/{r}"])]
            who = f"rank(s) {', '.join(map(str, missing))} did not" if missing else "not every rank did"
        except RuntimeError:
            who = "the store is gone; not every rank may have"
        warnings.warn(f"hpcrl.comm.shutdown on rank {ctx.rank}: {who} reach shutdown ({err})")
    unwatch_peers(done=True)
    for r in dropped:
        _say(f"hpcrl: {describe(ctx, r)} stopped beating before it reached the end of the run; not waited for")
    if dist.is_initialized() and not gone and not dropped:
        # With ranks gone, operations towards them may still be pending inside the groups: tearing the
        # groups down under them can abort the process; the process exit releases them instead.
        dist.destroy_process_group()
    return dropped


def _await_exits(store: dist.Store, ranks: list[int], expendable: list[int], timeout: timedelta,
                 heartbeat_timeout_s: float) -> list[int]:
    """Wait for ``ranks``' exit keys (RuntimeError after ``timeout``, as ``store.wait``), except for an
    ``expendable`` one whose heartbeat stalls first: those are returned, not waited for."""
    watcher = Watcher(liveness_store(store, heartbeat_timeout_s), expendable, heartbeat_timeout_s)
    deadline, left, dropped = time.monotonic() + timeout.total_seconds(), set(ranks), []
    while True:
        left = {r for r in left if not store.check([f"exit/{r}"])}
        if not left:
            return dropped
        stalled = [r for r in watcher.dead() if r in left]
        for r in stalled:
            watcher.forget(r)
            left.discard(r)
            dropped.append(r)
        if not left:
            return dropped
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout.total_seconds():g} s")
        try:  # woken by the next exit key, or within a poll to look at heartbeats again
            store.wait([f"exit/{min(left)}"], timedelta(seconds=0.5))
        except RuntimeError:
            pass

