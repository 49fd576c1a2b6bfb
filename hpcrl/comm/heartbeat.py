"""Heartbeats through the rendezvous store: counters, not timestamps, so clocks never matter.

Heartbeats and watchers talk to the store through their own client (:func:`liveness_store`), and
every watcher query runs under a deadline (:func:`bounded`): a store client's replies are read
without a timeout, so a frozen store host would block the caller forever; instead it is noticed
within the heartbeat timeout.

:class:`PeerWatch` is the whole-process form (FastSAC ranks): this rank's heartbeat plus a thread
that ends the process, with one line naming the peer, when a peer stops beating. A rank blocked in a
gloo or NCCL collective cannot be interrupted from Python, so the watcher exits the process itself.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from hpcrl.core.conventions import EXIT_FAILED

from .barrier import host_of, hosts
from .context import DistContext
from .env import detect_launch

__all__ = ["MAX_BEAT", "Heartbeat", "PeerLost", "PeerWatch", "StoreUnresponsive", "Watcher", "bounded", "describe",
           "heartbeat_key", "liveness_store", "remember_hosts"]


class PeerLost(RuntimeError):
    """A peer stopped responding; the message names it, ``peer`` its rank when one is to blame (None: the
    store, or no one rank). A spawned rank's launcher stops that peer and ends the run with this line."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class StoreUnresponsive(RuntimeError):
    """The rendezvous store did not answer within the deadline (its host froze or is gone)."""


_HOSTS: dict[int, str] = {}  # rank -> host, read once at start: naming a peer must not need the store


def remember_hosts(ctx: DistContext) -> None:
    _HOSTS.clear()
    _HOSTS.update(enumerate(hosts(ctx)))


def describe(ctx: DistContext, rank: int, role: str = "") -> str:
    """``"maker rank 3 (node7)"`` (``"rank 3 (node7)"`` without a role): how errors name a peer."""
    host = _HOSTS.get(rank) or host_of(ctx, rank)
    return (f"{role} " if role else "") + f"rank {rank}" + (f" ({host})" if host else "")


def liveness_store(store: dist.Store, timeout_s: float) -> dist.Store:
    """A separate client of ``store`` (own connection) whose every call gives up after ``timeout_s``."""
    client = store.clone()
    client.set_timeout(timedelta(seconds=timeout_s))
    return client


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


def _done_key(rank: int) -> str:
    return f"hb-done/{rank}"


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

    def last_seen(self, rank: int) -> tuple[int, float]:
        """(the last beat count seen, its ``time.time()``); count 0: never seen, since the watch began."""
        count, since = self._last[rank]
        return count, time.time() - (time.monotonic() - since)

    def forget(self, rank: int) -> None:
        self._last.pop(rank, None)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


class PeerWatch:
    """This rank's heartbeat and a watcher thread over every other rank (or over ``ranks``, named as
    ``role``); a peer silent for ``timeout_s`` (or a store that stops answering) ends this process:
    ``say(line)``, ``record(line, peer)``, then ``os._exit(EXIT_FAILED)``, as PPO's lost trainer is exit 1
    too. ``beat=False``: the caller beats already (its own :class:`Heartbeat`). :meth:`close` (the run
    ended here) marks this rank done, so peers still finishing do not take its silence for a freeze."""

    def __init__(self, ctx: DistContext, timeout_s: float, say: Callable[[str], None],
                 record: Callable[[str, int | None], None], poll_s: float = 0.5, ranks: list[int] | None = None,
                 role: str = "", beat: bool = True) -> None:
        assert ctx.store is not None
        self._ctx, self._timeout, self._say, self._record, self._poll = ctx, timeout_s, say, record, poll_s
        self._role = role
        remember_hosts(ctx)
        self._store = liveness_store(ctx.store, timeout_s)
        self._beat = Heartbeat(liveness_store(ctx.store, timeout_s), ctx.rank) if beat else None
        watched = [r for r in range(ctx.world_size) if r != ctx.rank] if ranks is None else ranks
        self._watcher = Watcher(self._store, [r for r in watched if r != ctx.rank], timeout_s)
        self._closed, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self._poll):
            try:
                dead = self._watcher.dead()
                dead = [r for r in dead if not self._done(r)]
            except (StoreUnresponsive, dist.DistError) as err:  # no answer, or the connection broke
                self._lost(self._store_lost(err), None if detect_launch().store_hosted_elsewhere else 0)
                return
            except RuntimeError as err:  # a malformed or unsigned heartbeat: someone else writes to the store
                self._lost(f"{err}; rank {self._ctx.rank} exits", None)
                return
            if dead:
                self._lost(self._stalled(dead), dead[0])
                return

    def _done(self, rank: int) -> bool:
        """``rank`` said it finished (read back signed: a forged "done" must not hide a frozen rank)."""
        key = _done_key(rank)
        if bounded(lambda: self._store.check([key]) and bytes(self._store.get(key)) == b"1", self._timeout):
            self._watcher.forget(rank)
            return True
        return False

    def _stalled(self, dead: list[int]) -> str:
        parts = []
        for rank in dead:
            count, when = self._watcher.last_seen(rank)
            seen = f"last seen {_clock(when)}, beat {count}" if count else "never seen since the watch began"
            parts.append(f"{describe(self._ctx, rank, self._role)} stopped responding: no heartbeat for "
                         f"{self._timeout:g} s ({seen})")
        return "; ".join(parts) + f"; rank {self._ctx.rank} exits"

    def _store_lost(self, err: BaseException) -> str:
        host = "the launcher" if detect_launch().store_hosted_elsewhere else describe(self._ctx, 0)
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{host}, which hosts the rendezvous store, stopped responding ({why}); rank {self._ctx.rank} exits"

    def _lost(self, line: str, peer: int | None) -> None:
        with self._lock:
            if self._closed.is_set():  # the run ended here meanwhile: nothing is lost
                return
            self._say(f"hpcrl: {line}")
            self._record(line, peer)
            os._exit(EXIT_FAILED)  # the main thread may sit in a collective no Python code can interrupt

    def await_verdict(self) -> None:
        """Block until the watch ends this process (a peer or the store is lost) or, within the heartbeat
        timeout, finds nothing wrong: after a collective failed, the watch's line is the better reason."""
        self._thread.join(self._timeout + 2 * self._poll + 1.0)

    def close(self, done: bool = True) -> None:
        """Stop watching (and beating); ``done``: this rank finished, peers may see it fall silent."""
        with self._lock:
            self._closed.set()
        # Let the watch thread finish the store query it may be in. A daemon thread that comes back from a
        # store call (C++, GIL released) into an interpreter that is exiting is ended by pthread_exit, whose
        # unwinding through a noexcept frame aborts the whole process ("terminate called without an active
        # exception", rc 134) after a run that succeeded.
        if threading.current_thread() is not self._thread:
            self._thread.join(self._timeout + 2 * self._poll + 1.0)
        if done:
            try:
                bounded(lambda: self._store.set(_done_key(self._ctx.rank), "1"), self._timeout)
            except (StoreUnresponsive, RuntimeError):  # the peers' watchers say what became of the store
                pass
        if self._beat is not None:
            self._beat.stop()
