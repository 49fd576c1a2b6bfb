"""Local multi-rank runs (``--nproc N``): N spawned processes that bootstrap like torchrun ranks.

The parent hosts the rendezvous store on a loopback port the OS picked (no "find a free port, then
hope nobody takes it" race) and tells the children, as torchrun's agent does, so every child is a
plain store client and rank 0 may leave first. Nothing listens beyond loopback: torch's TCPStore
server binds every interface whatever host it is given, so the parent binds the socket to
127.0.0.1 itself and hands it over (``master_listen_fd``), and gloo's pair listeners are pinned to
the loopback interface (``GLOO_SOCKET_IFNAME``). Each run gets a fresh job secret
(``HPCRL_JOB_SECRET``, only in the ranks' environments), so another local user who finds the
loopback port cannot write keys the ranks act on (see ``docs/trust.md``). Each child runs ``fn(*args)``, which calls
:func:`hpcrl.comm.init_distributed` like any entry point.

The parent supervises like an agent:

- **Stop signals are forwarded.** SIGTERM and SIGUSR2 sent to the parent (the pid a user, systemd
  or docker sees) go to every live rank; SIGINT (Ctrl-C) goes to them as SIGTERM, and the ranks
  ignore the terminal's own SIGINT, so Ctrl-C means "checkpoint and stop" too. A second SIGINT
  kills the ranks at once (no checkpoint) and raises :class:`KeyboardInterrupt`. A stop signal that
  reaches a rank before its function installed a handler (during start-up) is held and delivered to
  that handler; one that arrives after the function returned is ignored, so a late signal never
  turns a finished rank into a failure.
- **Ranks start in milliseconds.** They are forks of multiprocessing's forkserver, started once per
  launching process with torch already imported (:mod:`hpcrl.comm.forkserver_preload`), not fresh
  interpreters that import torch again (~1 s and ~200 MB each). A launcher that called
  :func:`~hpcrl.comm.prefork.prefork` before its own work has that server forked from itself (where it
  runs one thread and no GPU driver), so nothing it imported is imported twice. Each rank still gets what a spawned
  process would: the launcher's environment, stdout/stderr and signal mask as they are at launch, its
  own numpy seed, its thread count. Where there is no forkserver, ranks are spawned.
- **No orphans.** A rank dies with its parent (Linux: ``PR_SET_PDEATHSIG``), the forkserver, which
  exits with the launching process: a SIGKILLed launcher does not leave ranks training. (Spawned
  ranks follow the launcher's *thread* that started them: call :func:`spawn` from a thread that
  outlives them, normally the main thread.)
- **Scratch directories** (``hpcrl-spawn-<host>-<pid>-<start>-*`` in the temp dir: one per run, one for
  the forkserver's socket, under /tmp when $TMPDIR is too long for a socket path) are removed on
  every exit the parent lives through; those of dead parents (SIGKILL, power loss) are swept by the
  next :func:`spawn` on the same host.
- **Failures are attributed** to the rank whose exit the parent observed first (ties: a rank killed
  by a signal before one that raised, then the earlier exception), with its signal name, exit code
  or the exception's last line, not to a peer that died of it later.
- **A frozen rank** that its peers' heartbeat watch named (:mod:`hpcrl.comm.heartbeat`; the rank that
  noticed exits 1, with :class:`~hpcrl.comm.heartbeat.PeerLost` naming it or from its watch thread) is
  blamed with the watch's one line (:class:`SpawnPeerLost`) and SIGKILLed at once: a stopped process never
  acts on SIGTERM. That holds when the rank that noticed is expendable too: an essential rank frozen for
  good would hold the run for as long as it stays frozen. Any rank stopped on a failure that is in state
  ``T`` is SIGKILLed at once, for the same reason.
- **Configuration errors** raised inside a rank (an instance of one of
  :data:`~hpcrl.comm.spawn_errors.CONFIG_ERRORS`) come back as :class:`SpawnConfigError` carrying the rank's one-line
  message, so entry points exit 2 without a traceback however many ranks hit it.
- **Expendable ranks** (``expendable=``) may fail without stopping the others (detached PPO's
  makers): their failure is a warning line on stderr, and part of the error if the run fails. Once
  the others finished, one still running gets a grace period to leave on its own, except one that is
  stopped (state ``T``: SIGSTOP, it cannot act on anything) or that the run dropped
  (:func:`record_dropped`, e.g. a frozen maker): those are stopped at once; one both stopped and
  dropped is SIGKILLed as soon as both are seen, mid-run (woken, it would only leave).
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import pickle
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import torch.distributed as dist

from hpcrl.core.conventions import LAUNCHED_PID_ENV

from .rank_start import current_mask, is_open, start_method
from .scratch import make_scratch_dir
from .secret import SECRET_ENV, new_secret
from .spawn_child import STOP_SIGNALS, InheritedFd, run_child
from .spawn_errors import (CONFIG_ERRORS, DATA_ERRORS, SpawnConfigError, SpawnDataError, SpawnError, is_config_error,
                           is_data_error)
from .spawn_exits import Exits, read_error
from .spawn_signals import Forwarder
from .spawn_stops import kill_frozen, record_dropped, stop_ranks, stop_unwanted, take, warn
from .stop import INTERRUPT_ENV

__all__ = ["CONFIG_ERRORS", "DATA_ERRORS", "FORWARD_SIGNALS", "SpawnConfigError", "SpawnDataError", "SpawnError",
           "is_config_error", "is_data_error", "record_dropped", "spawn"]

_EXPENDABLE_GRACE_S = 30.0  # expendable ranks still running this long after the others finished are stopped
_INTERRUPTED = "interrupted"  # a file in the scratch dir: the SIGTERMs the ranks get are a forwarded Ctrl-C
_LOOK_S = 0.25  # how often the expendable ranks still running after the others finished are looked at

FORWARD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
"""What :func:`spawn` forwards to its ranks by default (SIGINT as SIGTERM)."""


# -- the parent -------------------------------------------------------------------------------------
def _loopback_store(nproc: int) -> dist.TCPStore:
    """A store server listening on 127.0.0.1 only. TCPStore(host=...) would bind every interface
    (its server ignores the host), so the socket is bound here and handed over; the store owns it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, nproc, True, timedelta(seconds=60), wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on BSD / macOS)."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float | None = None,
    num_threads: int | None = 1,
    env: dict[str, str] | None = None,
    forward_signals: Sequence[int] = FORWARD_SIGNALS,
    expendable: Collection[int] = (),
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` fresh processes as ranks 0..nproc-1; return their results.

    ``fn`` must be importable (module level: ranks receive it pickled by name) and its result
    picklable. Each child gets ``MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK`` (plus ``env``)
    and ``torch.set_num_threads(num_threads)`` (None: ``OMP_NUM_THREADS``, else every CPU it may use):
    N ranks with all-core thread pools oversubscribe a small machine badly.

    ``forward_signals`` (default SIGTERM, SIGUSR2, SIGINT; ``()`` to leave signals alone) are
    forwarded to the live ranks while they run (see the module doc; SIGINT as SIGTERM, a second one
    kills the ranks and raises :class:`KeyboardInterrupt`); the previous handlers are restored on
    return. Forwarding needs the main thread and is skipped elsewhere.

    When a rank fails, the others are stopped and :class:`SpawnError` names the rank that failed
    first and carries its traceback (:class:`SpawnConfigError` when it raised a configuration
    error); past ``timeout_s`` all are stopped and the still-running ranks are named. A failing rank
    in ``expendable`` is reported (a warning line) and the others go on; its result is None. Expendable
    ranks still running ``_EXPENDABLE_GRACE_S`` after every other rank returned are stopped (result None).
    A configuration error stops the run whichever rank raised it.

    ``preload``: modules every rank imports (the rank function's, a model library's), imported once by
    the forkserver when this call starts it instead of by each rank; a server already running keeps
    what it has (ranks import what it lacks themselves). Importing them must start no thread.
    """
    expendable = _check_ranks(nproc, expendable)
    procs: list = []
    running: set[int] = set()
    job = Job(procs, running, Forwarder(forward_signals, procs, running))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        job.fwd.install()
        _launch(job, fn, tuple(args), nproc, num_threads, env, preload)
        _supervise(job, expendable, deadline, timeout_s)
        return _results(job, nproc, expendable)
    finally:
        job.running.clear()
        stop_ranks(job.procs, range(len(job.procs)), job.exits)
        if job.tmp is not None:
            shutil.rmtree(job.tmp, ignore_errors=True)
        job.fwd.restore()


@dataclass
class Job:
    """What :func:`spawn` started, filled in as it goes (so its cleanup finds whatever exists)."""

    procs: list
    running: set[int]  # ranks whose exit is not yet observed (shared with the signal forwarder)
    fwd: Forwarder
    store: dist.TCPStore | None = None  # held for the run: the ranks' rendezvous lives as long as this object
    tmp: str | None = None
    exits: Exits | None = None


def _check_ranks(nproc: int, expendable: Collection[int]) -> frozenset[int]:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    expendable = frozenset(int(r) for r in expendable)
    if not expendable <= set(range(nproc)):
        raise ValueError(f"expendable ranks {sorted(expendable - set(range(nproc)))} outside 0..{nproc - 1}")
    return expendable


def _child_env(rank: int, nproc: int, port: int, tmp: str, secret: str, env: dict[str, str] | None) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the parent hosts it (see module doc)
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "HPCRL_LAUNCHER": "local",  # torchrun-style variables, but the run reports "local"
        LAUNCHED_PID_ENV: str(os.getpid()),  # the run-dir lock names the pid the user started
        INTERRUPT_ENV: str(Path(tmp, _INTERRUPTED)),
        "GLOO_SOCKET_IFNAME": _loopback_interface(),  # gloo listens where the hostname resolves
        SECRET_ENV: secret,
        **(env or {}),
    }


def _launch(job: Job, fn: Callable[..., Any], args: tuple, nproc: int, num_threads: int | None,
            env: dict[str, str] | None, preload: Sequence[str]) -> None:
    """Host the store, make the scratch dir and start the ranks, the forwarded signals held meanwhile."""
    fwd = job.fwd
    blocked = fwd.signals if fwd.active and hasattr(signal, "pthread_sigmask") else ()
    # what the ranks hold for their StopRequest: the forwarded stop signals (SIGINT arrives as SIGTERM)
    ignore_sigint = fwd.active and signal.SIGINT in fwd.signals
    hold = tuple(s for s in STOP_SIGNALS if fwd.active and (s in fwd.signals or (s == signal.SIGTERM and ignore_sigint)))
    # Forwarded signals wait (pending) until every rank exists; the ranks start with them blocked and
    # unblock them once their handlers are in place, so a signal during start-up stops them too.
    if blocked:  # its first launch unblocks SIGINT and SIGTERM in this thread (bpo-33613): launch it now
        multiprocessing.resource_tracker.ensure_running()
    ctx, server = start_method(preload)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if blocked else None
    mask = old_mask if old_mask is not None else current_mask()
    try:
        job.store = _loopback_store(nproc)
        secret = new_secret()
        job.tmp = tmp = make_scratch_dir()
        job.exits = Exits(job.procs, tmp, fwd)
        fwd.marker = Path(tmp, _INTERRUPTED)
        streams = [InheritedFd(fd) if is_open(fd) else None for fd in (1, 2)]
        for rank in range(nproc):
            child_env = {**os.environ, **_child_env(rank, nproc, job.store.port, tmp, secret, env)}
            p = ctx.Process(target=run_child, name=f"rank{rank}",
                            args=(fn, args, child_env, num_threads, tmp, (server or os.getpid(), os.getpid()), hold,
                                  ignore_sigint, mask, streams))
            job.procs.append(p)
            p.start()
            job.running.add(rank)
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # pending signals are forwarded now


def _supervise(job: Job, expendable: frozenset[int], deadline: float | None, timeout_s: float | None) -> None:
    """Wait for every rank; stop the others and raise on the first essential failure, the timeout or
    (expendable ranks only) the grace period after the essential ones finished."""
    procs, running, exits = job.procs, job.running, job.exits
    assert exits is not None and job.tmp is not None
    essential = set(range(len(procs))) - expendable
    lost: list[int] = []  # expendable ranks that failed
    grace_end: float | None = None
    while running:
        if grace_end is None and essential and not (essential & running):
            grace_end = time.monotonic() + _EXPENDABLE_GRACE_S
        if expendable & running:
            stop_unwanted(job, expendable, finished=grace_end is not None)
            if not running:
                break
        ends = [t for t in (deadline, grace_end) if t is not None]
        remaining = None if not ends else max(0.0, min(ends) - time.monotonic())
        if expendable & running:  # look again soon: a rank may freeze, or be dropped, meanwhile
            remaining = min(_LOOK_S, remaining if remaining is not None else _LOOK_S)
        ready = multiprocessing.connection.wait([procs[r].sentinel for r in running], remaining)
        if not ready:
            if deadline is not None and time.monotonic() >= deadline:
                names = ", ".join(f"rank {r}" for r in sorted(running))
                stop_ranks(procs, take(running), exits)
                raise SpawnError(f"timed out after {timeout_s:g} s; still running: {names}", None, None)
            if grace_end is not None and time.monotonic() >= grace_end:
                late = sorted(running)
                stop_ranks(procs, take(running), exits)
                warn(f"expendable rank(s) {', '.join(map(str, late))} still running {_EXPENDABLE_GRACE_S:g} s "
                      "after the others finished: stopped")
            continue
        batch = [r for r in running if procs[r].sentinel in ready]
        for r in batch:
            running.discard(r)  # first: the signal forwarder must not signal a pid once it is reaped
            procs[r].join()
        for r in exits.observe(batch):
            if exits.succeeded(r):
                continue
            if r in expendable and not _ends_run(job, r, expendable):
                lost.append(r)
                warn(f"rank {r} failed ({exits.describe(r)}); it is expendable, the others go on without it")
                continue
            first = exits.first(r, lost)
            if (peer := exits.lost_peer(first)) is not None:
                kill_frozen(procs[peer])
            stop_ranks(procs, take(running), exits)
            raise exits.failure(first, lost)


def _ends_run(job: Job, rank: int, expendable: frozenset[int]) -> bool:
    """An expendable ``rank``'s failure ends the run too: a configuration error (every rank has it), or its
    heartbeat watch found an essential rank frozen or gone (e.g. a maker that lost its trainer; the frozen
    trainer would otherwise hold the run for as long as it stays frozen). Not once that peer finished: a
    rank that outlived it may take its silence for a freeze."""
    assert job.exits is not None and job.tmp is not None
    rec = read_error(job.tmp, rank)
    peer = job.exits.lost_peer(rank)
    lost = peer is not None and peer not in expendable and not job.exits.succeeded(peer)
    return bool(rec is not None and rec.get("config")) or lost


def _results(job: Job, nproc: int, expendable: frozenset[int]) -> list[Any]:
    assert job.exits is not None and job.tmp is not None
    results = []
    for rank in range(nproc):
        try:
            with open(Path(job.tmp, f"result-{rank}"), "rb") as f:
                results.append(pickle.load(f))
        except FileNotFoundError:
            if rank not in expendable:
                raise SpawnError(f"rank {rank} failed first ({job.exits.describe(rank)})", rank,
                                 job.procs[rank].exitcode) from None
            results.append(None)
    return results
