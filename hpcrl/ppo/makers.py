"""A trainer's ledger of its makers: credits, experience in credit order, liveness, drop and re-issue, drain.

:class:`MakerLedger` does its I/O only through the channels it is given (:class:`MakerWires`), so
one process can drive it with fakes. Its threads (one experience receiver per maker, linked or not:
when makers die the modulo rule re-links the live ones) start in :meth:`MakerLedger.start`. Only
the caller's thread (the trainer's main thread) changes the credit bookkeeping; the receivers only
fill the inbox, and no lock is held across a communication call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from .channels import ChannelError, Credit, CreditChannel, ExperienceChannel, Header, StatusChannel
from .liveness import PeerLost, Watcher
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
        self._pending: deque[int] = deque()  # credit ids in grant order: experience is handed out oldest-first
        self._credit_maker: dict[int, int] = {}
        self._sending: dict[int, list] = {}  # maker -> credit sends posted and not yet completed (work, tensor)
        self._credit_sent: dict[int, tuple] = {}  # credit id -> its send, until its batch is handed out
        self._arrived: dict[int, Received] = {}
        self._failed: dict[int, BaseException] = {}  # maker -> what its receive thread hit (written there)
        self._lost: list[int] = []  # dropped since the last take_lost()
        self._inbox: queue.Queue = queue.Queue()
        self._next_look = 0.0
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
        return self._pending[0] if self._pending else self.next_credit

    @property
    def pending(self) -> int:
        return len(self._pending)

    # credits ------------------------------------------------------------------------------------
    def grant(self, count: int, min_version: int) -> None:
        """Hand ``count`` credits to my live makers, round-robin, requiring ``min_version``. The sends are
        posted, not waited for (a frozen maker must not hold the caller); a failed post drops the maker."""
        self._min_version = min_version
        for _ in range(count):
            mine = self.top.makers_of(self.trainer, self.live())
            if not mine:
                raise PeerLost(f"trainer {self.trainer}: every maker is dead (lost: {sorted(self.dead)}); "
                               "cannot continue")
            m = mine[self._cursor % len(mine)]
            self._cursor += 1
            credit = self.next_credit
            try:
                sent = self.wires.credits.grant(self.top.maker_rank(m), Credit(self.trainer, min_version, credit))
            except Exception:
                self.drop(m)
                self.grant(1, min_version)
                continue
            self._sending.setdefault(m, []).append(sent)
            self._credit_sent[credit] = sent
            self.next_credit += 1
            self._pending.append(credit)
            self._credit_maker[credit] = m
            self.outstanding[m] += 1

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
        reports done; a lost maker's count outlives it)."""
        made = []
        for m in range(self.top.makers):
            if m not in self.dead:
                try:
                    self.wires.status.wait_done(m, timeout_s)
                except RuntimeError:
                    raise PeerLost(f"trainer {self.trainer}: {self._name(self.top.maker_rank(m), 'maker')} did not "
                                   f"finish within {timeout_s:.0f} s of the STOP credit") from None
            try:
                made.append(self.wires.status.produced(m))
            except ChannelError as err:
                raise PeerLost(f"trainer {self.trainer}: {err}") from None
        return made

    # losses -------------------------------------------------------------------------------------
    def drop(self, m: int) -> None:
        """Maker ``m`` is lost: its un-arrived credits are re-issued to the live makers (unless draining)."""
        if m in self.dead:
            return
        self.dead.add(m)
        self._lost.append(m)
        self.wires.makers.forget(self.top.maker_rank(m))
        self.wires.status.drop(m)  # should it wake up (a freeze), it learns it and leaves
        if isinstance(self._failed.get(m), ChannelError):
            print(f"hpcrl.ppo: trainer {self.trainer}: dropping {self._name(self.top.maker_rank(m), 'maker')}: "
                  f"{self._failed[m]}", flush=True)
        lost = [c for c in self._pending if self._credit_maker[c] == m and c not in self._arrived]
        self._pending = deque(c for c in self._pending if c not in lost)
        self.outstanding[m] = 0
        if lost and not self.draining:
            self.grant(len(lost), self._min_version)

    def take_lost(self) -> list[int]:
        """The makers dropped since the last call (the trainer tells its publisher)."""
        lost, self._lost = self._lost, []
        return lost

    def check_peers(self) -> None:
        """Raise PeerLost naming a trainer that stopped; drop makers whose heartbeat stalled, whose credit
        send failed or whose stream broke (garbage, or gone before its heartbeat stalls)."""
        try:
            dead_trainers = self.wires.trainers.dead()
        except Exception as err:
            raise PeerLost(f"trainer {self.trainer}: lost the rendezvous store hosted by trainer rank 0: "
                           f"{err}") from None
        if dead_trainers:
            raise PeerLost(f"trainer {self.trainer}: " + ", ".join(self._name(r, "trainer") for r in dead_trainers)
                           + f" stopped responding (no heartbeat for {self.heartbeat_timeout_s:.0f} s)")
        for rank in self.wires.makers.dead():
            self.drop(self.top.maker_index(rank))
        for m, sends in list(self._sending.items()):  # forget delivered credits; a failed send loses its maker
            self._sending[m] = [(work, msg) for work, msg in sends if not work.is_completed()]
            if m in self.dead:
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

    # experience ---------------------------------------------------------------------------------
    def next_batch(self, between: Callable[[], None] = _nothing) -> Received:
        """The batch of the oldest outstanding credit (later arrivals wait), so lag stays <= the bound;
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

    def _poll(self, deadline: float, between: Callable[[], None]) -> Received | None:
        """The oldest credit's batch if it is here, else None after one wait on the inbox."""
        if time.monotonic() >= self._next_look:  # also while experience flows: a frozen maker is dropped
            self._next_look = time.monotonic() + self.LOOK_S
            self.check_peers()
            between()
        if self._pending and self._pending[0] in self._arrived:
            item = self._arrived.pop(self._pending.popleft())
            self._delivered(item.header.maker, item.header.credit)
            self.outstanding[item.header.maker] -= 1
            self.used[item.header.maker] += item.header.samples
            return item
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
        if item.header.maker not in self.dead and self._credit_maker.get(item.header.credit) == item.header.maker:
            self._arrived[item.header.credit] = item
        # else it arrived after we gave up on its maker (credit re-issued), or is not a credit we gave it
        return None

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
        """Wait (one deadline) for the live makers to close their streams after STOP; a lost maker's
        receiver stays blocked: a daemon, not waited for."""
        deadline = time.monotonic() + timeout_s
        for m, thread in self._receivers.items():
            if m not in self.dead:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _receive_loop(self, m: int) -> None:
        rank = self.top.maker_rank(m)
        while True:
            try:
                got = self.wires.experience.receive(rank)
            except Exception as err:  # garbage or gone: the main thread drops it (and names why, if garbage)
                self._failed[m] = err
                return
            if got is None:
                return
            self._inbox.put(Received(*got))
