"""A trainer's ledger of its makers: credits, experience hand-out, liveness, drop and re-issue, drain, end.

:class:`MakerLedger` does its I/O only through the channels it is given (:class:`MakerWires`), so
one process can drive it with fakes. Its threads (one experience receiver per maker, linked or not:
when makers die the modulo rule re-links the live ones) start in :meth:`MakerLedger.start`. Only
the caller's thread (the trainer's main thread) changes the credit bookkeeping; the receivers only
fill the inbox, and no lock is held across a communication call.

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
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from hpcrl.comm.local import record_dropped

from .channels import ChannelError, Credit, CreditChannel, ExperienceChannel, Header, StatusChannel
from .liveness import PeerLost, Watcher, bounded, liveness_store
from .topology import Topology

__all__ = ["MakerLedger", "MakerWires", "Received"]


@dataclass
class Received:
    header: Header
    payload: torch.Tensor


@dataclass
class MakerWires:
    """What a ledger talks through: credits out, experience in, the makers' store records, and the
    heartbeat watchers of the makers and of the other trainers."""

    credits: CreditChannel
    experience: ExperienceChannel
    status: StatusChannel
    makers: Watcher
    trainers: Watcher


def _nothing() -> None:
    pass


class MakerLedger:
    """Trainer ``trainer``'s side of the makers of ``top``. ``name(rank, role)`` names a peer in errors."""

    LOOK_S = 0.5  # how often the peers' heartbeats are read while waiting for experience (also while it flows)
    POLL_S = 0.25  # one wait on the inbox

    def __init__(self, trainer: int, top: Topology, wires: MakerWires, timeout_s: float, heartbeat_timeout_s: float,
                 name: Callable[[int, str], str] = lambda rank, role: f"{role} rank {rank}") -> None:
        self.trainer, self.top, self.wires = trainer, top, wires
        self.timeout_s, self.heartbeat_timeout_s, self._name = timeout_s, heartbeat_timeout_s, name
        self.dead: set[int] = set()  # maker indices
        self.used = [0] * top.makers  # samples per maker handed out: consumed, dropped as stale or drained
        self.outstanding = [0] * top.makers  # credits granted and not yet handed out as experience
        self.next_credit = 0  # the id of the next credit granted (a resume continues the numbering)
        self.draining = False  # a lost maker's credits are not re-issued any more
        self._min_version = 0  # the version the latest grant required (re-issued credits require it too)
        self._cursor = 0
        self._pending: deque[int] = deque()  # credit ids in grant order (so in order of required version)
        self._credit_maker: dict[int, int] = {}
        self._credit_version: dict[int, int] = {}  # credit id -> the version it requires, while pending
        self._ahead: set[int] = set()  # handed out while an older credit is still pending
        self._skip: set[int] = set()  # ids a resumed run does not grant again (handed out before its checkpoint)
        self._sending: dict[int, list] = {}  # maker -> credit sends posted and not yet completed (work, tensor)
        self._credit_sent: dict[int, tuple] = {}  # credit id -> its send, until its batch is handed out
        self._arrived: dict[int, Received] = {}
        self._failed: dict[int, BaseException] = {}  # maker -> what its receive thread hit (written there)
        self._closed: set[int] = set()  # makers whose stream ended normally (written by its receive thread)
        self._finished: set[int] = set()  # makers that finished the run: their silence is not a freeze
        self._lost: list[int] = []  # dropped since the last take_lost()
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
    def first_untrained(self) -> int:
        """The oldest credit not handed out yet (a resume collects it again)."""
        return self._pending[0] if self._pending else self._next_id(self.next_credit)

    @property
    def taken_ahead(self) -> list[int]:
        """Credits after :attr:`first_untrained` whose batches were handed out already (ahead of an older
        one): what a resume at :attr:`first_untrained` must not collect again."""
        first = self.first_untrained
        return sorted(c for c in self._ahead | self._skip if c > first)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def resume(self, next_credit: int, taken_ahead: list[int] | tuple[int, ...] = ()) -> None:
        """Continue a checkpointed run: the next credit is ``next_credit``, and the ids in ``taken_ahead``
        (trained before the checkpoint) are never granted."""
        self._skip = {int(c) for c in taken_ahead if int(c) >= next_credit}
        self.next_credit = self._next_id(int(next_credit))

    def _next_id(self, credit: int) -> int:
        while credit in self._skip:
            credit += 1
        return credit

    # credits ------------------------------------------------------------------------------------
    def grant(self, count: int, min_version: int) -> None:
        """Hand ``count`` credits to my live makers, requiring ``min_version``; each to the linked maker
        with the fewest batches in flight (round-robin among equals). The sends are posted, not waited
        for (a frozen maker must not hold the caller); a failed post drops the maker."""
        self._min_version = min_version
        for _ in range(count):
            mine = self.top.makers_of(self.trainer, self.live())
            if not mine:
                raise PeerLost(f"trainer {self.trainer}: every maker is dead (lost: {sorted(self.dead)}); "
                               "cannot continue")
            m = self._pick(mine)
            credit = self.next_credit = self._next_id(self.next_credit)
            try:
                sent = self.wires.credits.grant(self.top.maker_rank(m), Credit(self.trainer, min_version, credit))
            except Exception:
                self.drop(m)
                self.grant(1, min_version)
                continue
            self._sending.setdefault(m, []).append(sent)
            self._credit_sent[credit] = sent
            self.next_credit = self._next_id(credit + 1)
            self._pending.append(credit)
            self._credit_maker[credit] = m
            self._credit_version[credit] = min_version
            self.outstanding[m] += 1

    def _pick(self, mine: list[int]) -> int:
        """The maker of ``mine`` with the fewest credits whose batch has not arrived, the rotation
        deciding among equals (``min`` keeps the first of equals in rotation order)."""
        in_flight = dict.fromkeys(mine, 0)
        for c in self._pending:
            if c not in self._arrived and self._credit_maker[c] in in_flight:
                in_flight[self._credit_maker[c]] += 1
        start = self._cursor % len(mine)
        m = min(mine[start:] + mine[:start], key=in_flight.__getitem__)
        self._cursor = mine.index(m) + 1
        return m

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
    def drop(self, m: int) -> None:
        """Maker ``m`` is lost: its un-arrived credits are re-issued to the live makers (unless draining)."""
        if m in self.dead:
            return
        self.dead.add(m)
        self._lost.append(m)
        self.wires.makers.forget(self.top.maker_rank(m))
        self.wires.status.drop(m)  # should it wake up (a freeze), it learns it and leaves; the other trainers drop it
        record_dropped(self.top.maker_rank(m))  # under --nproc: the parent need not wait for it at the end
        if isinstance(self._failed.get(m), ChannelError):
            print(f"hpcrl.ppo: trainer {self.trainer}: dropping {self._name(self.top.maker_rank(m), 'maker')}: "
                  f"{self._failed[m]}", flush=True)
        lost = [c for c in self._pending if self._credit_maker[c] == m and c not in self._arrived]
        self._pending = deque(c for c in self._pending if c not in lost)
        for c in lost:
            self._credit_version.pop(c, None)
        self.outstanding[m] = 0
        if lost and not self.draining:
            self.grant(len(lost), self._min_version)

    def take_lost(self) -> list[int]:
        """The makers dropped since the last call (the trainer tells its publisher)."""
        lost, self._lost = self._lost, []
        return lost

    def check_peers(self) -> None:
        """Raise PeerLost naming a trainer that stopped; drop makers whose heartbeat stalled, that another
        trainer dropped, whose credit send failed or whose stream broke (garbage, or gone before its
        heartbeat stalls)."""
        try:
            dead_trainers = self.wires.trainers.dead()
        except Exception as err:
            raise self._store_lost(err) from None
        if dead_trainers:
            raise PeerLost(f"trainer {self.trainer}: " + ", ".join(self._name(r, "trainer") for r in dead_trainers)
                           + f" stopped responding (no heartbeat for {self.heartbeat_timeout_s:.0f} s)")
        self._apply_marks()
        self._check_makers()

    def _check_makers(self) -> None:
        """The makers' half of :meth:`check_peers` (at the end, after the other trainers may have left)."""
        try:
            stalled = self.wires.makers.dead()
        except Exception as err:
            raise self._store_lost(err) from None
        for rank in stalled:
            if self.top.maker_index(rank) not in self._finished:
                self.drop(self.top.maker_index(rank))
        for m, sends in list(self._sending.items()):  # forget delivered credits; a failed send loses its maker
            self._sending[m] = [(work, msg) for work, msg in sends if not work.is_completed()]
            if m in self.dead or m in self._finished:
                continue
            try:
                for work, _ in sends:
                    if work.is_completed():
                        work.wait()
            except Exception:
                self.drop(m)
        for m, err in list(self._failed.items()):
            if isinstance(err, ChannelError):
                self.drop(m)

    def _apply_marks(self) -> None:
        """Drop the makers another trainer dropped."""
        if self._marks is None:
            return
        live = self.live()
        try:
            marked = bounded(lambda: [m for m in live if self._marks.dropped(m)], self.heartbeat_timeout_s)
        except Exception as err:
            raise self._store_lost(err) from None
        for m in marked:
            self.drop(m)

    def _store_lost(self, err: BaseException) -> PeerLost:
        return PeerLost(f"trainer {self.trainer}: lost the rendezvous store hosted by trainer rank 0: {err}")

    # experience ---------------------------------------------------------------------------------
    def next_batch(self, between: Callable[[], None] = _nothing) -> Received:
        """The next batch to train on (see the module doc for the order), so lag stays <= the bound;
        ``between()`` runs after every look at the peers (the trainer follows lost makers there)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            item = self._poll(deadline, between)
            if item is not None:
                return item

    def drain(self, between: Callable[[], None] = _nothing) -> float:
        """Collect every outstanding rollout (each wait bounded by the timeout; makers that die are dropped
        and their credits not re-issued): the samples dropped at shutdown."""
        self.draining = True
        dropped = 0.0
        deadline = time.monotonic() + self.timeout_s
        try:
            while self._pending:  # a drop may empty it while we wait
                item = self._poll(deadline, between)
                if item is not None:
                    dropped += item.header.samples
                    deadline = time.monotonic() + self.timeout_s
        except PeerLost as err:
            print(f"hpcrl.ppo: trainer {self.trainer}: gave up collecting the last rollouts: {err}", flush=True)
        return dropped

    def _ready(self) -> int | None:
        """The credit whose batch goes next, if it is here: the oldest outstanding one; or, while the
        outstanding credits span versions, the oldest that has arrived (see the module doc)."""
        if not self._pending:
            return None
        head = self._pending[0]
        if head in self._arrived:
            return head
        if not self._arrived or self._credit_version[head] == self._credit_version[self._pending[-1]]:
            return None  # one version outstanding (--lag 0): credit order keeps a step's batches as they are
        return next((c for c in self._pending if c in self._arrived), None)

    def _poll(self, deadline: float, between: Callable[[], None]) -> Received | None:
        """A batch to hand out if one is here (:meth:`_ready`), else None after one wait on the inbox."""
        if time.monotonic() >= self._next_look:  # also while experience flows: a frozen maker is dropped
            self._next_look = time.monotonic() + self.LOOK_S
            self.check_peers()
            between()
        credit = self._ready()
        if credit is not None:
            return self._hand_out(credit)
        try:
            item = self._inbox.get(timeout=self.POLL_S)
        except queue.Empty:
            self.check_peers()
            between()
            if time.monotonic() > deadline:
                waiting = [m for m in self.live() if self.outstanding[m]]
                raise PeerLost(f"trainer {self.trainer}: no experience within {self.timeout_s:.0f} s from "
                               + (", ".join(self._name(self.top.maker_rank(m), "maker") for m in waiting)
                                  or "any maker")) from None
            return None
        if item.header.maker not in self.dead and self._credit_maker.get(item.header.credit) == item.header.maker \
                and item.header.credit in self._credit_version:
            self._arrived[item.header.credit] = item
        # else it arrived after we gave up on its maker (credit re-issued), or is not a credit we gave it
        return None

    def _hand_out(self, credit: int) -> Received:
        if credit == self._pending[0]:
            self._pending.popleft()
        else:
            self._pending.remove(credit)
            self._ahead.add(credit)
        if self._ahead or self._skip:  # only ids after the oldest outstanding one need remembering
            first = self.first_untrained
            self._ahead = {c for c in self._ahead if c > first}
            self._skip = {c for c in self._skip if c >= self.next_credit or c > first}
        item = self._arrived.pop(credit)
        self._credit_version.pop(credit, None)
        self._delivered(item.header.maker, credit)
        self.outstanding[item.header.maker] -= 1
        self.used[item.header.maker] += item.header.samples
        return item

    def _delivered(self, m: int, credit: int) -> None:
        """Its batch is here, so the credit's send landed: settle it (a gloo send reports completion only
        once waited for, so without this every credit's send would be kept for the whole run)."""
        sent = self._credit_sent.pop(credit, None)
        if sent is None:
            return
        self._sending[m] = [s for s in self._sending.get(m, []) if s[0] is not sent[0]]
        try:
            sent[0].wait()
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
