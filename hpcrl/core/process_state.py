"""Is a process (by pid) still the one we knew, and is it on its way out: read from /proc, for the
run-dir lock (:mod:`hpcrl.run.rundir`) and the scratch dirs (:mod:`hpcrl.comm.scratch`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["being_killed", "pid_alive", "proc_start"]


def proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the "(comm)" field


def pid_alive(pid: int, start: str) -> bool:
    """``pid`` runs and is the process that started at ``start`` (:func:`proc_start`; "" = unknown)."""
    if pid <= 0:  # never os.kill(0 or -1, ...): those address process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return not start or not (now := proc_start(pid)) or now == start  # a reused pid is another process


_PF_EXITING = 0x4  # task flag (linux/sched.h): the process is in its exit path
_SIGKILL_BIT = 1 << (9 - 1)


def being_killed(pid: int) -> bool:
    """``pid`` is on its way out: a zombie, in its exit path, or with a SIGKILL pending."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:  # state, flags (fields 3 and 9)
            return True
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
                return True
    except (OSError, IndexError, ValueError):
        pass
    return False
