"""Ranks started as torchrun starts them: one ``python -m MODULE`` per rank with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set, no supervising parent (each rank rendezvouses on its own). Shared by the
tests that launch that way (tests/test_sac_frozen.py, tests/test_reshard.py)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port(lo: int = 10000, hi: int | None = None) -> int:
    """A port free now, drawn at random from ``[lo, hi]`` below the kernel's ephemeral range. A port the OS
    hands out for ``bind(0)`` is ephemeral: once released, any outgoing connection (gloo opens many in the
    tests running beside this one) may take it before the rank binds it (EADDRINUSE). Below the range only an
    explicit bind takes a port."""
    hi = min(hi or 65535, _ephemeral_start() - 1)
    for _ in range(200):
        port = random.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{lo}, {hi}]")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a surrounding Slurm job's variables, one intra-op thread, ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1", **extra}


def torchrun_style(module: str, args: list[str], world: int) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m module *args`` started as torchrun does; stdout and stderr piped (text)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", module, *args],
                             env=clean_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of every rank once all exited; all are killed when one outlives ``timeout``."""
    deadline, out = time.monotonic() + timeout, []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out
