"""The local ranks a process started with :func:`hpcrl.comm.spawn`, found in /proc: children of that
process's forkserver (ranks are forks of it; a server forked from the process has its command line), or of
the process itself under the "spawn" start method."""

from __future__ import annotations

from pathlib import Path


def _children(pid: int) -> list[tuple[int, int, bytes]]:
    """(start time, pid, cmdline) of ``pid``'s live children."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid:
            out.append((int(stat[19]), int(entry.name), cmdline))
    return out


def ranks_of(parent: int) -> list[int]:
    """``parent``'s ranks in rank order (they are started one after another)."""
    kids = _children(parent)
    found = [k for k in kids if b"spawn_main" in k[2]]
    own = Path(f"/proc/{parent}/cmdline").read_bytes()
    for _, server, cmdline in kids:
        if b"forkserver" in cmdline or cmdline == own:
            found += _children(server)
    return [pid for _, pid, _ in sorted(found)]
