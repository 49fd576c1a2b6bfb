"""Heartbeats through the rendezvous store: counters, not timestamps, so clocks never matter."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from hpcrl.comm import DistContext, host_of


class PeerLost(RuntimeError):
    """A peer stopped responding; the message names it."""


def describe(ctx: DistContext, rank: int, role: str) -> str:
    """``"maker rank 3 (node7)"``: how errors name a peer."""
    host = host_of(ctx, rank)
    return f"{role} rank {rank}" + (f" ({host})" if host else "")


class Heartbeat:
    """Background thread bumping ``hb/<rank>`` every ``interval_s``."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float = 0.5) -> None:
        self._store, self._key, self._interval = store, f"hb/{rank}", interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store host is gone; watchers on the other side will notice us
                return

    def stop(self) -> None:
        self._stop.set()


class Watcher:
    """Declares a rank dead when its heartbeat counter has not moved for ``timeout_s``."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float) -> None:
        self._store, self._timeout = store, timeout_s
        now = time.monotonic()
        self._last = {r: (-1, now) for r in ranks}

    def dead(self) -> list[int]:
        now, out = time.monotonic(), []
        for rank, (count, since) in self._last.items():
            current = self._store.add(f"hb/{rank}", 0)
            if current != count:
                self._last[rank] = (current, now)
            elif now - since > self._timeout:
                out.append(rank)
        return out

    def forget(self, rank: int) -> None:
        self._last.pop(rank, None)
