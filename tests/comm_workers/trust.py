"""Ranks of tests/test_trust.py: which sockets a rank (and its spawn parent) listens on, and a rank
that joins a job and reports how it was refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp{,6}


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's little-endian hex address as text: "127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0"."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # four host-order 32-bit words
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == _LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.append((_address(addr), int(port, 16)))
    return found


def report_listeners() -> dict:
    """After the bootstrap and a barrier (every gloo pair connected): this rank's, the spawn parent's
    (the store host's) and the forkserver's (this rank's parent process) listening sockets."""
    from hpcrl.comm import barrier, init_distributed, shutdown
    from hpcrl.run.rundir import LAUNCHED_PID_ENV

    ctx = init_distributed(timeout_s=30)
    barrier(ctx, "listeners")
    launcher = int(os.environ[LAUNCHED_PID_ENV])
    out = {"rank": ctx.rank, "self": listening(os.getpid()), "parent": listening(launcher),
           "server": listening(os.getppid()) if os.getppid() != launcher else [],
           "signed": ctx.store.signed, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    barrier(ctx, "reported")  # nobody leaves (closing its listeners) before all have looked
    shutdown(timeout_s=15)
    return out


if __name__ == "__main__":
    # A rank started by tests/test_trust.py with torchrun-style variables: joins, or prints why not.
    from hpcrl.comm import DistSetupError, init_distributed, shutdown

    try:
        ctx = init_distributed(timeout_s=float(os.environ.get("TRUST_TIMEOUT_S", "20")))
    except DistSetupError as err:
        print(f"refused: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print("joined", flush=True)
    shutdown(timeout_s=5)
