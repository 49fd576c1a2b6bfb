"""How :func:`hpcrl.comm.spawn`'s parent stops ranks: SIGTERM, then SIGKILL after a grace period, and at
once SIGKILL for a rank that is stopped (state ``T``: a SIGSTOPped process never acts on SIGTERM); the
expendable ranks nobody waits for; and what a rank tells its parent about a dropped peer
(:func:`record_dropped`)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Collection

from .spawn_child import scratch_dir, write_atomic

if TYPE_CHECKING:
    from .local import Job
    from .spawn_exits import Exits

__all__ = ["KILL_GRACE_S", "is_stopped", "kill_frozen", "record_dropped", "stop_ranks", "stop_unwanted", "take",
           "warn"]

KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL when spawn stops ranks itself


def stop_ranks(procs: list, ranks: Collection[int], exits: Exits | None = None) -> None:
    """SIGTERM the still-running ``ranks`` (SIGKILL one that is stopped), SIGKILL those left after the
    grace period; reap them all."""
    alive = [r for r in ranks if procs[r].pid and procs[r].exitcode is None and procs[r].is_alive()]
    for r in alive:
        if is_stopped(procs[r].pid):
            kill_frozen(procs[r])
        else:
            procs[r].terminate()
        if exits is not None:
            exits.stopped.add(r)
    deadline = time.monotonic() + KILL_GRACE_S
    for r in alive:
        procs[r].join(max(0.0, deadline - time.monotonic()))
        if procs[r].is_alive():
            procs[r].kill()
    for p in procs:
        if p.pid:
            p.join()


def record_dropped(rank: int) -> None:
    """Inside a spawned rank: the run dropped ``rank`` (an expendable rank, e.g. a maker that froze past
    the heartbeat timeout), so once the others finished the parent stops it at once instead of granting
    it the grace period. Outside :func:`spawn`, nothing."""
    tmp = scratch_dir()
    if tmp is None:
        return
    try:
        write_atomic(Path(tmp, dropped_name(rank)), b"")
    except OSError:  # the parent then grants it the grace period: slower, no worse
        pass


def dropped_name(rank: int) -> str:
    return f"dropped-{int(rank)}"


def is_stopped(pid: int | None) -> bool:
    """``pid`` is in state T (stopped by SIGSTOP / SIGTSTP): it acts on nothing until SIGCONT (Linux;
    elsewhere False). A tracer's stop (``t``, a debugger) is left alone."""
    if not pid:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def stop_unwanted(job: Job, expendable: frozenset[int], finished: bool) -> None:
    """Stop at once the expendable ranks nobody waits for: one that is stopped (state T) and that the run
    dropped, at any time (SIGKILL: a stopped process never acts on SIGTERM; woken, it would only leave,
    and until it is gone its peers' connections to it hold their own exits); once the essential ranks
    ``finished``, any stopped one (SIGKILL) and any dropped one (SIGTERM, then SIGKILL)."""
    assert job.tmp is not None
    candidates = job.running & expendable
    marked = {r for r in candidates if Path(job.tmp, dropped_name(r)).exists()}
    frozen = [r for r in candidates if (finished or r in marked) and is_stopped(job.procs[r].pid)]
    dropped = [r for r in marked if r not in frozen] if finished else []
    job.running.difference_update(frozen + dropped)  # first: the signal forwarder must not signal them any more
    for r in frozen:
        kill_frozen(job.procs[r])
    for r in dropped:
        if job.procs[r].exitcode is None and job.procs[r].is_alive():
            job.procs[r].terminate()
    if job.exits is not None:
        job.exits.stopped.update(frozen + dropped)
    deadline = time.monotonic() + KILL_GRACE_S
    for r in dropped:
        job.procs[r].join(max(0.0, deadline - time.monotonic()))
        if job.procs[r].is_alive():
            job.procs[r].kill()
    for r in frozen + dropped:
        job.procs[r].join()
    if frozen or dropped:
        why = ([f"rank {r} is stopped (SIGSTOP)" + (" and was dropped by the run" if r in marked else "")
                for r in frozen] + [f"rank {r} was dropped by the run" for r in dropped])
        warn(f"expendable {', '.join(why)}" + ("; the others finished" if finished else "") + ": stopped at once")


def kill_frozen(proc) -> None:
    """SIGKILL a rank its peers found frozen: a SIGSTOPped process never acts on SIGTERM."""
    if proc.pid and proc.exitcode is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def take(running: set[int]) -> set[int]:
    """Empty ``running`` (the signal forwarder's list: no signal to a pid once it may be reaped), return its ranks."""
    ranks = set(running)
    running.clear()
    return ranks


def warn(message: str) -> None:
    print(f"hpcrl.comm.spawn: warning: {message}", file=sys.stderr, flush=True)
