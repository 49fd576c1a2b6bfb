"""Ranks leaving a job while one of them, expendable, freezes just before it reaches shutdown."""

from __future__ import annotations

import os
import signal
import time

from hpcrl.comm import init_distributed, shutdown
from hpcrl.comm.heartbeat import Heartbeat, liveness_store
from hpcrl.comm.local import record_dropped

HEARTBEAT_S = 2.0


def main() -> dict:
    ctx = init_distributed(timeout_s=30)
    beat = Heartbeat(liveness_store(ctx.store, HEARTBEAT_S), ctx.rank)
    if ctx.rank == 2:  # done with its work, frozen before its exit key: only its heartbeat can tell
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        dropped = shutdown(timeout_s=25, expendable=[2], heartbeat_timeout_s=HEARTBEAT_S)
    finally:
        beat.stop()
    for rank in dropped:
        record_dropped(rank)  # the launcher stops the frozen rank at once instead of after its grace
    return {"dropped": dropped, "waited_s": time.monotonic() - t0}
