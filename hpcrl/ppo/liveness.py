"""Heartbeats through the rendezvous store: counters, not timestamps, so clocks never matter.

Heartbeats and watchers talk to the store through their own client (:func:`liveness_store`), and
every watcher query runs under a deadline (:func:`bounded`): a store client's replies are read
without a timeout, so a frozen store host (trainer 0 when no launcher hosts the store) would block
the caller forever; instead it is noticed within the heartbeat timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from hpcrl.comm import DistContext, host_of, hosts


class PeerLost(RuntimeError):
    """A peer stopped responding; the message names it."""


class Dropped(RuntimeError):
    """This maker was declared lost by the trainers (it froze past the heartbeat timeout), or the run
    finished while it was away."""


_HOSTS: dict[int, str] = {}  # rank -> host, read once at start: naming a peer must not need the store


def remember_hosts(ctx: DistContext) -> None:
    _HOSTS.clear()
    _HOSTS.update(enumerate(hosts(ctx)))


def describe(ctx: DistContext, rank: int, role: str) -> str:
    """``"maker rank 3 (node7)"``: how errors name a peer."""
    host = _HOSTS.get(rank) or host_of(ctx, rank)
    return f"{role} rank {rank}" + (f" ({host})" if host else "")


def liveness_store(store: dist.Store, timeout_s: float) -> dist.Store:
    """A separate client of ``store`` (own connection) whose every call gives up after ``timeout_s``."""
    client = store.clone()
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


class StoreUnresponsive(RuntimeError):
    """The rendezvous store did not answer within the deadline (its host froze or is gone)."""


def bounded(fn, timeout_s: float):
    """``fn()`` on a daemon thread, its result within ``timeout_s`` or StoreUnresponsive. A call that
    never returns leaves only that daemon thread behind (blocked in a socket read)."""
    box: list = []

    def call() -> None:
        try:
            box.append((True, fn()))
        except BaseException as err:  # re-raised on the caller's thread
            box.append((False, err))

    worker = threading.Thread(target=call, name="store-query", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        raise StoreUnresponsive(f"the rendezvous store did not answer within {timeout_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


MAX_BEAT = 1 << 62  # a heartbeat count beyond this is not one a rank wrote (0.5 s beats: ~10^11 years)


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


class Heartbeat:
    """Background thread publishing ``hb/<rank>`` = its beat count every ``interval_s``.

    A ``set`` of this rank's own count, not a shared ``add`` counter: through the job's
    :class:`~hpcrl.comm.secret.SignedStore` the value is signed, so a process without the job secret
    cannot keep a dead rank "alive" (a forged or replayed older count never counts as a beat: the
    watchers require the count to grow). The first beat is published before the constructor returns.
    """

    def __init__(self, store: dist.Store, rank: int, interval_s: float = 0.5) -> None:
        self._store, self._key, self._interval = store, heartbeat_key(rank), interval_s
        self._count = 0
        self._beat()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        try:
            self._store.set(self._key, str(self._count))
        except Exception:  # store slow or gone: keep trying; if it is gone, our watchers say so
            pass

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1.0)  # not inside a store call when the process exits


class Watcher:
    """Declares a rank dead when its heartbeat counter has not moved for ``timeout_s``."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float) -> None:
        self._store, self._timeout = store, timeout_s
        now = time.monotonic()
        self._last = {r: (0, now) for r in ranks}
        self._seen: set[int] = set()  # ranks whose key exists: read in one multi_get from then on

    def _counts(self, ranks: list[int]) -> list[int]:
        """Each rank's published beat count (0: none yet), bounds-checked. Ranks not seen yet are
        looked up one by one (a get of a missing key would block until the store timeout)."""
        unseen = [r for r in ranks if r not in self._seen]
        for r in unseen:
            if self._store.check([heartbeat_key(r)]):
                self._seen.add(r)
        seen = [r for r in ranks if r in self._seen]
        values = dict(zip(seen, self._store.multi_get([heartbeat_key(r) for r in seen]))) if seen else {}
        out = []
        for r in ranks:
            raw = values.get(r, b"0")
            text = bytes(raw[:32]).decode(errors="replace")
            if len(raw) > 20 or not text.isdigit() or int(text) > MAX_BEAT:
                raise PeerLost(f"store key {heartbeat_key(r)!r}: malformed heartbeat {bytes(raw[:40])!r} (a count "
                               f"0..{MAX_BEAT} was expected): is another program writing to this run's store?")
            out.append(int(text))
        return out

    def dead(self) -> list[int]:
        """Ranks whose heartbeat stalled; raises StoreUnresponsive when the store itself does not answer
        and :class:`~hpcrl.comm.secret.UntrustedKeyError` for a heartbeat not signed with the job secret."""
        ranks = list(self._last)
        # The time the counts were asked for, taken before asking: a watcher frozen (SIGSTOP, swapped
        # out) between reading the counts and reading the clock would otherwise pair old counts with a
        # late time and declare a peer that beat all along dead.
        now, out = time.monotonic(), []
        counts = bounded(lambda: self._counts(ranks), self._timeout)
        for rank, current in zip(ranks, counts):
            count, since = self._last[rank]
            if current > count:  # only growth is a beat: a replayed older value is not
                self._last[rank] = (current, now)
            elif now - since > self._timeout:
                out.append(rank)
        return out

    def forget(self, rank: int) -> None:
        self._last.pop(rank, None)
