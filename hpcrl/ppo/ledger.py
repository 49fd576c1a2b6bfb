"""A trainer's ledger of its makers: credits, experience hand-out, liveness, drop, drain, end.

:class:`MakerLedger` does its I/O only through the channels it is given (:class:`MakerWires`), so
one process can drive it with fakes. Its threads (one experience receiver per maker, linked or not:
when makers die the modulo rule re-links the live ones) start in :meth:`MakerLedger.start`. Only
the caller's thread (the trainer's main thread) changes the credit bookkeeping; the receivers only
fill the inbox, and no lock is held across a communication call. Each granted credit is one
:class:`~hpcrl.ppo.credits.Credit` in :attr:`MakerLedger.credits`; the rules that pick among them
are the pure functions of :mod:`hpcrl.ppo.credits`.

Losses are returned, not acted on: :meth:`MakerLedger.poll`, :meth:`MakerLedger.check_peers` and
:meth:`MakerLedger.drop` return the makers dropped and how many of their credits must be granted
again (:class:`Lost`); the trainer tells its publisher and grants them (:meth:`MakerLedger.reissue`).
Only a failed credit post is settled inside :meth:`MakerLedger.grant`: it drops that maker and grants
its credits to the others in the same loop.

Order of hand-out. While every outstanding credit requires the same policy version (always at
``--lag 0``: its credits are exactly one step's batches), batches are handed out in credit order, so
a step's batches are the same, in the same order, whatever order they arrive in (``--lag 0`` stays
exact); waiting for the oldest then costs nothing, as the step needs every one of them. Once the
outstanding credits span versions (``--lag`` >= 1), the oldest batch that has arrived goes first: a
frozen maker's credit does not hold up live makers' batches until the heartbeat timeout drops it.
Lag stays bounded (a credit granted later requires a newer version; a skipped credit whose batch
comes back too old is dropped as stale by the trainer), and new credits go to the linked maker with
the fewest batches in flight (round-robin among equals: the plain rotation whenever every maker has
answered, as at ``--lag 0``), so a frozen maker stops collecting credits. Credits handed out ahead
of an older outstanding one are :attr:`MakerLedger.taken_ahead`: a resume at
:attr:`MakerLedger.first_untrained` skips them (:meth:`MakerLedger.resume`), so a dataset
workload's batch ``b`` (a fixed slice) is still trained at most once.

Every trainer drops a maker any trainer dropped (the store's dropped mark): the run's accounting
(``makers_lost``) and the weight stream agree, whichever trainer noticed the freeze. A maker that
freezes or dies after the drain is still noticed within the heartbeat timeout (:meth:`produced`,
:meth:`join`), never waited for until ``--timeout-s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hpcrl.comm.heartbeat import PeerLost, Watcher, bounded, liveness_store
from hpcrl.comm.local import record_dropped

from .channels import CreditChannel, ExperienceChannel
from .credits import Credit, Received, lost_with, next_id, next_ready, pick_maker, still_taken
from .topology import Topology
from .wire import ChannelError, StatusChannel
from .wire import Credit as CreditMessage

__all__ = ["Lost", "MakerLedger", "MakerWires", "Polled"]


@dataclass
class MakerWires:
    """What a ledger talks through: credits out, experience in, the makers' store records, and the
    heartbeat watchers of the makers and of the other trainers."""

    credits: CreditChannel
    experience: ExperienceChannel
    status: StatusChannel
    makers: Watcher
    trainers: Watcher


@dataclass(frozen=True)
class Lost:
    """Makers a ledger dropped, and how many of their credits must be granted again (none while
    draining, and none for what :meth:`MakerLedger.grant` granted again itself)."""

    makers: tuple[int, ...] = ()
    credits: int = 0

    def __add__(self, other: Lost) -> Lost:
        return Lost(self.makers + other.makers, self.credits + other.credits)


@dataclass(frozen=True)
class Polled:
    """What one :meth:`MakerLedger.poll` came back with: a batch to train on, or None; the makers lost."""

    batch: Received | None = None
    lost: Lost = field(default_factory=Lost)


class MakerLedger:
    """Trainer ``trainer``'s side of the makers of ``top``. ``name(rank, role)`` names a peer in errors."""

    LOOK_S = 0.5  # how often the peers' heartbeats are read while waiting for experience (also while it flows)
    POLL_S = 0.25  # one wait on the inbox

    def __init__(self, trainer: int, top: Topology, wires: MakerWires, timeout_s: float, heartbeat_timeout_s: float,
                 name: Callable[[int, str], str] = lambda rank, role: f"{role} rank {rank}") -> None:
        self.trainer, self.top, self.wires = trainer, top, wires
        self.timeout_s, self.heartbeat_timeout_s, self._name = timeout_s, heartbeat_timeout_s, name
        self.credits: dict[int, Credit] = {}  # granted, not handed out yet; in grant order (so of required version)
        self.next_credit = 0  # the id of the next credit granted (a resume continues the numbering)
        self.min_version = 0  # the version the latest grant required (re-issued credits require it too)
        self.draining = False  # a lost maker's credits are not re-issued any more
        # ids after the oldest untrained credit that were trained already (handed out ahead of it here, or
        # before the checkpoint this run resumed from): never granted, and a resume skips them
        self._taken: set[int] = set()
        self._cursor = 0
        self.dead: set[int] = set()  # maker indices
        self.used = [0] * top.makers  # samples per maker handed out: consumed, dropped as stale or drained
        self._sending: dict[int, list] = {}  # maker -> sends posted (credits, STOP) and not seen completed
        self._failed: dict[int, BaseException] = {}  # maker -> what its receive thread hit (written there)
        self._closed: set[int] = set()  # makers whose stream ended normally (written by its receive thread)
        self._finished: set[int] = set()  # makers that finished the run: their silence is not a freeze
        self._inbox: queue.Queue = queue.Queue()
        self._next_look = 0.0
        # Another trainer's drops, read from the store (only another trainer can drop a maker this one
        # counts live): through an own client, under a deadline, as the heartbeats are.
        self._marks = (StatusChannel(wires.status.store, live=liveness_store(wires.status.store, heartbeat_timeout_s))
                       if top.trainers > 1 else None)
        self._receivers = {m: threading.Thread(target=self._receive_loop, args=(m,), name=f"experience-in-{m}",
                                               daemon=True) for m in range(top.makers)}

    def start(self) -> None:
        for thread in self._receivers.values():
            thread.start()

    def live(self) -> list[int]:
        return [m for m in range(self.top.makers) if m not in self.dead]

    @property
    def outstanding(self) -> list[int]:
        """Per maker: credits granted and not handed out yet."""
        counts = [0] * self.top.makers
        for c in self.credits.values():
            counts[c.maker] += 1
        return counts

    @property
    def first_untrained(self) -> int:
        """The oldest credit not handed out yet (a resume collects it again)."""
        return next(iter(self.credits)) if self.credits else next_id(self.next_credit, self._taken)

    @property
    def taken_ahead(self) -> list[int]:
        """Credits after :attr:`first_untrained` whose batches were handed out already (ahead of an older
        one): what a resume at :attr:`first_untrained` must not collect again."""
        first = self.first_untrained
        return sorted(c for c in self._taken if c > first)

    @property
    def pending(self) -> int:
        return len(self.credits)

    def resume(self, next_credit: int, taken_ahead: list[int] | tuple[int, ...] = ()) -> None:
        """Continue a checkpointed run: the next credit is ``next_credit``, and the ids in ``taken_ahead``
        (trained before the checkpoint) are never granted."""
        self._taken = {int(c) for c in taken_ahead if int(c) >= next_credit}
        self.next_credit = next_id(int(next_credit), self._taken)

    # credits ------------------------------------------------------------------------------------
    def grant(self, count: int, min_version: int) -> Lost:
        """Hand ``count`` credits to my live makers, requiring ``min_version``; each to the linked maker
        with the fewest batches in flight (round-robin among equals, :func:`~hpcrl.ppo.credits.pick_maker`).
        The sends are posted, not waited for (a frozen maker must not hold the caller); a failed post
        drops the maker, and its credits are granted to the others here. Returns the makers dropped."""
        self.min_version = min_version
        dropped = Lost()
        while count:
            mine = self.top.makers_of(self.trainer, self.live())
            if not mine:
                raise PeerLost(f"trainer {self.trainer}: every maker is dead (lost: {sorted(self.dead)}); "
                               "cannot continue")
            m, self._cursor = pick_maker(mine, self.credits, self._cursor)
            credit = self.next_credit = next_id(self.next_credit, self._taken)
            try:
                sent = self.wires.credits.grant(self.top.maker_rank(m),
                                                CreditMessage(self.trainer, min_version, credit))
            except Exception:
                lost = self.drop(m)
                dropped, count = dropped + Lost(lost.makers), count + lost.credits
                continue
            self._sending.setdefault(m, []).append(sent)
            self.credits[credit] = Credit(credit, m, min_version, sent)
            self.next_credit = next_id(credit + 1, self._taken)
            count -= 1
        return dropped

    def reissue(self, count: int) -> Lost:
        """Grant again ``count`` credits lost with their makers, requiring what the latest grant required."""
        return self.grant(count, self.min_version)

    def stop_all(self) -> None:
        """Trainer 0 at the end: the run is finished (a maker that missed the end, frozen, learns it from the
        store), then STOP credits to every live maker (posted and kept like credits)."""
        self.wires.status.finish()
        for m in self.live():
            try:
                self._sending.setdefault(m, []).append(self.wires.credits.stop(self.top.maker_rank(m)))
            except Exception:  # gone in the meantime: nothing to stop
                pass

    def produced(self, timeout_s: float) -> list[float]:
        """Trainer 0 after STOP: the samples each maker produced (a live maker's count is final once it
        reports done; a lost maker's count outlives it). A maker that freezes or dies meanwhile is dropped
        within the heartbeat timeout (and counted lost); a live one that keeps beating without reporting
        done is named after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._apply_marks()  # dropped by another trainer (then it may have reported done: it is lost all the same)
            for m in self.live():
                if m not in self._finished and self._reported_done(m):
                    self._finish(m)
            waiting = [m for m in self.live() if m not in self._finished]
            if not waiting:
                break
            self._check_makers()
            waiting = [m for m in waiting if m not in self.dead]
            if waiting and time.monotonic() > deadline:
                raise PeerLost(f"trainer {self.trainer}: {self._name(self.top.maker_rank(waiting[0]), 'maker')} "
                               f"did not finish within {timeout_s:.0f} s of the STOP credit")
            time.sleep(self.POLL_S)
        made = []
        for m in range(self.top.makers):
            try:
                made.append(self.wires.status.produced(m))
            except ChannelError as err:
                raise PeerLost(f"trainer {self.trainer}: {err}") from None
        return made

    def _reported_done(self, m: int) -> bool:
        try:
            self.wires.status.wait_done(m, 0.01)
            return True
        except RuntimeError:
            return False

    def _finish(self, m: int) -> None:
        """Maker ``m`` finished the run: it stops beating, which is no freeze."""
        self._finished.add(m)
        self.wires.makers.forget(self.top.maker_rank(m))

    # losses -------------------------------------------------------------------------------------
    def drop(self, m: int) -> Lost:
        """Maker ``m`` is lost: it is told through the store and forgotten, and its credits whose batch
        has not arrived are discarded. Returns it and how many credits to grant again (none while
        draining); nothing if it was lost already."""
        if m in self.dead:
            return Lost()
        self.dead.add(m)
        self.wires.makers.forget(self.top.maker_rank(m))
        self.wires.status.drop(m)  # should it wake up (a freeze), it learns it and leaves; the other trainers drop it
        record_dropped(self.top.maker_rank(m))  # under --nproc: the parent need not wait for it at the end
        if isinstance(self._failed.get(m), ChannelError):
            print(f"hpcrl.ppo: trainer {self.trainer}: dropping {self._name(self.top.maker_rank(m), 'maker')}: "
                  f"{self._failed[m]}", flush=True)
        lost = lost_with(self.credits, m)
        for c in lost:
            del self.credits[c]
        return Lost((m,), 0 if self.draining else len(lost))

    def check_peers(self) -> Lost:
        """Raise PeerLost naming a trainer that stopped; drop makers whose heartbeat stalled, that another
        trainer dropped, whose credit send failed or whose stream broke (garbage, or gone before its
        heartbeat stalls). Returns what was lost."""
        try:
            dead_trainers = self.wires.trainers.dead()
        except Exception as err:
            raise self._store_lost(err) from None
        if dead_trainers:
            raise PeerLost(f"trainer {self.trainer}: " + ", ".join(self._name(r, "trainer") for r in dead_trainers)
                           + f" stopped responding (no heartbeat for {self.heartbeat_timeout_s:.0f} s)")
        return self._apply_marks() + self._check_makers()

    def _check_makers(self) -> Lost:
        """The makers' half of :meth:`check_peers` (at the end, after the other trainers may have left)."""
        try:
            stalled = self.wires.makers.dead()
        except Exception as err:
            raise self._store_lost(err) from None
        lost = Lost()
        for rank in stalled:
            if self.top.maker_index(rank) not in self._finished:
                lost += self.drop(self.top.maker_index(rank))
        for m, sends in list(self._sending.items()):  # forget delivered credits; a failed send loses its maker
            self._sending[m] = [(work, msg) for work, msg in sends if not work.is_completed()]
            if m in self.dead or m in self._finished:
                continue
            try:
                for work, _ in sends:
                    if work.is_completed():
                        work.wait()
            except Exception:
                lost += self.drop(m)
        for m, err in list(self._failed.items()):
            if isinstance(err, ChannelError):
                lost += self.drop(m)
        return lost

    def _apply_marks(self) -> Lost:
        """Drop the makers another trainer dropped."""
        if self._marks is None:
            return Lost()
        live = self.live()
        try:
            marked = bounded(lambda: [m for m in live if self._marks.dropped(m)], self.heartbeat_timeout_s)
        except Exception as err:
            raise self._store_lost(err) from None
        lost = Lost()
        for m in marked:
            lost += self.drop(m)
        return lost

    def _store_lost(self, err: BaseException) -> PeerLost:
        return PeerLost(f"trainer {self.trainer}: lost the rendezvous store hosted by trainer rank 0: {err}")

    # experience ---------------------------------------------------------------------------------
    def poll(self, deadline: float) -> Polled:
        """One round of the wait for the next batch (see the module doc for the order): the peers are looked
        at when due (also while experience flows: a frozen maker is dropped), then the batch that goes next
        is handed out if it is here, else the inbox is waited on once. A round that lost makers returns
        them before anything is handed out (the caller grants their credits again first). Raises
        PeerLost once no batch came by ``deadline``."""
        if time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + self.LOOK_S
            lost = self.check_peers()
            if lost.makers:
                return Polled(lost=lost)
        credit = next_ready(self.credits)
        if credit is not None:
            return Polled(self._hand_out(credit))
        try:
            item = self._inbox.get(timeout=self.POLL_S)
        except queue.Empty:
            lost = self.check_peers()
            if not lost.makers and time.monotonic() > deadline:
                outstanding = self.outstanding
                waiting = [m for m in self.live() if outstanding[m]]
                raise PeerLost(f"trainer {self.trainer}: no experience within {self.timeout_s:.0f} s from "
                               + (", ".join(self._name(self.top.maker_rank(m), "maker") for m in waiting)
                                  or "any maker")) from None
            return Polled(lost=lost)
        credit = self.credits.get(item.header.credit)
        if credit is not None and credit.maker == item.header.maker and item.header.maker not in self.dead:
            credit.batch = item
        # else it arrived after we gave up on its maker (credit re-issued), or is not a credit we gave it
        return Polled()

    def _hand_out(self, credit: int) -> Received:
        ahead = credit != next(iter(self.credits))
        record = self.credits.pop(credit)
        if ahead:
            self._taken.add(credit)
        if self._taken:  # only ids after the oldest outstanding one need remembering
            self._taken = still_taken(self._taken, self.first_untrained, self.next_credit)
        self._settle(record)
        self.used[record.maker] += record.batch.header.samples
        return record.batch

    def _settle(self, credit: Credit) -> None:
        """Its batch is here, so the credit's send landed: settle it (a gloo send reports completion only
        once waited for, so without this every credit's send would be kept for the whole run)."""
        work = credit.sent[0]
        self._sending[credit.maker] = [s for s in self._sending.get(credit.maker, []) if s[0] is not work]
        try:
            work.wait()
        except Exception:  # delivered all the same: the maker answered it
            pass

    def join(self, timeout_s: float) -> None:
        """Wait (one deadline) for the live makers to close their streams after STOP, dropping a maker that
        freezes or dies meanwhile (so the shutdown does not wait for it); a lost maker's receiver stays
        blocked: a daemon, not waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.live():
                if m in self._closed and m not in self._finished:
                    self._finish(m)
            waiting = [m for m in self.live() if self._receivers[m].is_alive() and m not in self._closed]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                return
            self._check_makers()
            self._receivers[waiting[0]].join(timeout=min(self.POLL_S, remaining))

    def _receive_loop(self, m: int) -> None:
        rank = self.top.maker_rank(m)
        while True:
            try:
                got = self.wires.experience.receive(rank)
            except Exception as err:  # garbage or gone: the main thread drops it (and names why, if garbage)
                self._failed[m] = err
                return
            if got is None:
                self._closed.add(m)
                return
            self._inbox.put(Received(*got))
