"""Local multi-rank runs (``--nproc N``): N spawned processes that bootstrap like torchrun ranks.

The parent hosts the rendezvous store on a loopback port the OS picked (no "find a free port, then
hope nobody takes it" race) and tells the children, as torchrun's agent does, so every child is a
plain store client and rank 0 may leave first. Each child runs ``fn(*args)``, which calls
:func:`hpcrl.comm.init_distributed` like any entry point.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["SpawnError", "spawn"]

_KILL_GRACE_S = 3.0


class SpawnError(RuntimeError):
    """A spawned rank failed (``rank``, ``exitcode``) or the run timed out (``rank`` is None)."""

    def __init__(self, message: str, rank: int | None, exitcode: int | None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def _child(fn: Callable[..., Any], args: Sequence[Any], env: dict[str, str], num_threads: int | None, tmp: str) -> None:
    os.environ.update(env)
    rank = env["RANK"]
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        result = fn(*args)
    except Exception:
        # A file, not a queue: a queue's feeder thread can deadlock a child that exits right after.
        Path(tmp, f"error-{rank}").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    with open(Path(tmp, f"result-{rank}"), "wb") as f:
        pickle.dump(result, f)


def _stop(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _failure(procs: list[mp.Process], tmp: str) -> SpawnError:
    """The earliest recorded failure is the cause; later ones are usually peers losing it."""
    errors = {}
    for rank in range(len(procs)):
        path = Path(tmp, f"error-{rank}")
        if path.exists():
            stamp, _, text = path.read_text().partition("\n")
            errors[rank] = (float(stamp), text)
    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if errors:
        rank = min(errors, key=lambda r: errors[r][0])
        detail = errors[rank][1]
    else:  # died before or outside fn (start-up error, signal): its stderr has the details
        rank, detail = failed[0], "no traceback recorded; see the rank's stderr"
    code = procs[rank].exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    others = [r for r in failed if r != rank]
    also = f" (also failed: {', '.join(f'rank {r}' for r in others)})" if others else ""
    return SpawnError(f"rank {rank} failed ({how}){also}:\n{detail}".rstrip(), rank, code)


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float | None = None,
    num_threads: int | None = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` fresh processes as ranks 0..nproc-1; return their results.

    ``fn`` must be importable (module level: the "spawn" start method pickles it by name) and its
    result picklable. Each child gets ``MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK`` (plus
    ``env``) and ``torch.set_num_threads(num_threads)`` unless ``num_threads`` is None: N ranks
    with all-core thread pools oversubscribe a small machine badly. When a rank fails, the others
    are killed and :class:`SpawnError` names the rank and carries its traceback; past
    ``timeout_s`` all are killed and the still-running ranks are named.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    store = dist.TCPStore("127.0.0.1", 0, nproc, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="hpcrl-spawn-") as tmp:
        procs: list[mp.Process] = []
        try:
            for rank in range(nproc):
                child_env = {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",  # the parent hosts it (see module doc)
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "HPCRL_LAUNCHER": "local",  # torchrun-style variables, but the run reports "local"
                    **(env or {}),
                }
                p = ctx.Process(target=_child, args=(fn, tuple(args), child_env, num_threads, tmp), name=f"rank{rank}")
                p.start()
                procs.append(p)
            running = set(range(nproc))
            while running:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = multiprocessing.connection.wait([procs[r].sentinel for r in running], remaining)
                if not ready:
                    names = ", ".join(f"rank {r}" for r in sorted(running))
                    raise SpawnError(f"timed out after {timeout_s:g} s; still running: {names}", None, None)
                for r in list(running):
                    if procs[r].sentinel in ready:
                        procs[r].join()
                        running.discard(r)
                        if procs[r].exitcode != 0:
                            raise _failure(procs, tmp)
            results = []
            for rank in range(nproc):
                with open(Path(tmp, f"result-{rank}"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            _stop(procs)
