"""Scratch directories (``hpcrl-spawn-<host>-<pid>-<start>-*``): one per :func:`hpcrl.comm.spawn` in the temp
dir, removed on every exit the parent lives through, and one per shared-memory segment in /dev/shm
(:mod:`hpcrl.comm.shm`), removed once every rank mapped it; those of dead creators (SIGKILL, power loss) are
swept by the next one made in the same place on the same host."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile

from hpcrl.core import process_state

__all__ = ["PREFIX", "host_tag", "make_scratch_dir", "start_tag", "sweep_scratch"]

PREFIX = "hpcrl-spawn-"


def host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:40] or "host"


def start_tag(pid: int) -> str:
    """The process's start time (:func:`hpcrl.core.process_state.proc_start`), "0" where /proc is not available: a
    field of the scratch directory's name."""
    return process_state.proc_start(pid) or "0"


def _owner_alive(pid: int, start: str) -> bool:
    return process_state.pid_alive(pid, "" if start == "0" else start)


_SCRATCH = re.compile(re.escape(PREFIX) + r"(?P<host>.+)-(?P<pid>\d+)-(?P<start>\d+)-[A-Za-z0-9_]+")


def sweep_scratch(root: str | None = None) -> list[str]:
    """Remove this user's scratch directories left on this host by parents that are gone; return them."""
    root = root or tempfile.gettempdir()
    host, uid, removed = host_tag(), os.getuid(), []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _SCRATCH.fullmatch(entry.name)
        if not m or m["host"] != host:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if not _owner_alive(int(m["pid"]), m["start"]):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def make_scratch_dir(root: str | None = None) -> str:
    """A new scratch directory in ``root`` (default: the temp dir), after sweeping the dead ones there."""
    sweep_scratch(root)
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{host_tag()}-{pid}-{start_tag(pid)}-", dir=root)
