"""The trainer's maker ledger and trainer 0's publisher in one process, over fake channels.

Each test drives a :class:`hpcrl.ppo.ledger.MakerLedger` (credits, experience in credit order, drop
and re-issue, drain, accounting) or a :class:`hpcrl.ppo.publisher.Publisher` the way the trainer does:
through the trainer's own methods (:meth:`Trainer._next_batch`, :meth:`Trainer._follow_losses`,
:meth:`Trainer._drain`), bound to a stand-in holding just what they read.
"""

from __future__ import annotations

import queue
import threading
import time
from types import MethodType, SimpleNamespace

import pytest
import torch

from hpcrl.comm.heartbeat import PeerLost
from hpcrl.ppo.channels import ChannelError, Header
from hpcrl.ppo.ledger import Lost, MakerLedger, MakerWires
from hpcrl.ppo.publisher import Publisher
from hpcrl.ppo.rows import closing_row
from hpcrl.ppo.topology import Topology
from hpcrl.ppo.trainer import Trainer

pytestmark = pytest.mark.timeout(10)

SAMPLES = 8


class Work:
    """A posted send: completes when ``done`` is set; ``error`` is what its wait raises."""

    def __init__(self, done: bool = True, error: BaseException | None = None) -> None:
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class Credits:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []  # (maker rank, Credit)
        self.works: dict[int, list[Work]] = {}
        self.frozen: set[int] = set()  # ranks whose sends never complete (a frozen receiver)
        self.stopped: list[int] = []

    def grant(self, rank: int, credit) -> tuple[Work, None]:
        self.sent.append((rank, credit))
        work = Work(done=rank not in self.frozen)
        self.works.setdefault(rank, []).append(work)
        return work, None

    def stop(self, rank: int) -> tuple[Work, None]:
        self.stopped.append(rank)
        return Work(), None

    def to(self, rank: int) -> list[int]:
        return [c.credit_id for r, c in self.sent if r == rank]


class Experience:
    """One queue per maker rank; ``answer`` is a maker sending the batch of one credit."""

    def __init__(self, ranks: list[int]) -> None:
        self.queues: dict[int, queue.Queue] = {r: queue.Queue() for r in ranks}

    def receive(self, rank: int):
        got = self.queues[rank].get()
        if isinstance(got, BaseException):
            raise got
        return got

    def answer(self, top: Topology, rank: int, credit: int, version: int = 0, samples: int = SAMPLES) -> None:
        header = Header(top.maker_index(rank), credit, 0, version, samples, 1)
        self.queues[rank].put((header, torch.zeros(1, dtype=torch.uint8)))

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)


class Status:
    def __init__(self) -> None:
        self.dropped: set[int] = set()
        self.finished = False
        self.done: set[int] = set()
        self.counts: dict[int, float] = {}

    def drop(self, m: int) -> None:
        self.dropped.add(m)

    def finish(self) -> None:
        self.finished = True

    def wait_done(self, m: int, timeout_s: float) -> None:
        if m not in self.done:
            raise RuntimeError("timeout")

    def produced(self, m: int) -> float:
        return self.counts.get(m, 0.0)


class Heartbeats:
    def __init__(self) -> None:
        self.stalled: set[int] = set()
        self.forgotten: set[int] = set()

    def dead(self) -> list[int]:
        return sorted(self.stalled - self.forgotten)

    def forget(self, rank: int) -> None:
        self.forgotten.add(rank)


def as_trainer(ledger: MakerLedger, top: Topology, publisher: Publisher | None = None) -> SimpleNamespace:
    """What the trainer's side of the makers reads (its ledger, publisher, topology, index), with the
    trainer's own methods bound to it: wait for a batch, follow up losses, drain."""
    trainer = SimpleNamespace(makers=ledger, publisher=publisher, top=top, index=ledger.trainer)
    for name in ("_next_batch", "_follow_losses", "_drain"):
        setattr(trainer, name, MethodType(getattr(Trainer, name), trainer))
    return trainer


@pytest.fixture
def world():
    """A trainer's ledger of 2 makers (ranks 1, 2), started, with its fakes and the trainer that drives
    it (``w.trainer``: trainer 0 with no publisher); receivers closed afterwards."""
    made = []

    def make(makers: int = 2, timeout_s: float = 5.0) -> SimpleNamespace:
        top = Topology(1, makers)
        ranks = [top.maker_rank(m) for m in range(makers)]
        w = SimpleNamespace(top=top, credits=Credits(), experience=Experience(ranks), status=Status(),
                            makers=Heartbeats(), trainers=Heartbeats())
        w.ledger = MakerLedger(0, top, MakerWires(w.credits, w.experience, w.status, w.makers, w.trainers), timeout_s,
                               heartbeat_timeout_s=1.0)
        w.ledger.LOOK_S, w.ledger.POLL_S = 0.02, 0.01
        w.ledger.start()
        w.trainer = as_trainer(w.ledger, top)
        made.append(w)
        return w

    yield make
    for w in made:
        w.experience.close()


def test_experience_is_handed_out_in_credit_order(world):
    w = world()
    w.ledger.grant(3, min_version=0)  # round-robin: credits 0, 2 to maker 0 (rank 1), 1 to maker 1 (rank 2)
    assert w.credits.to(1) == [0, 2] and w.credits.to(2) == [1]
    assert w.ledger.outstanding == [2, 1]
    w.experience.answer(w.top, 2, 1)  # later credits arrive first ...
    w.experience.answer(w.top, 1, 2)
    threading.Timer(0.1, w.experience.answer, (w.top, 1, 0)).start()
    t0 = time.monotonic()
    assert w.trainer._next_batch().header.credit == 0  # ... and wait for the oldest
    assert time.monotonic() - t0 >= 0.09
    assert [w.trainer._next_batch().header.credit for _ in range(2)] == [1, 2]
    assert w.ledger.outstanding == [0, 0] and w.ledger.used == [2 * SAMPLES, SAMPLES]
    assert w.ledger.first_untrained == w.ledger.next_credit == 3  # a checkpoint now resumes at credit 3


def test_lost_makers_credits_are_reissued_to_the_live_ones(world):
    w = world()
    w.ledger.grant(4, min_version=3)  # maker 0: credits 0, 2; maker 1: 1, 3
    w.experience.answer(w.top, 1, 0)
    assert w.trainer._next_batch().header.credit == 0
    w.makers.stalled.add(2)  # maker 1's heartbeat stalls before it answered anything
    lost = w.ledger.check_peers()  # what a poll does every LOOK_S
    assert lost == Lost(makers=(1,), credits=2) and w.ledger.check_peers() == Lost()  # reported once
    w.trainer._follow_losses(lost)  # what the trainer does with it
    for credit in (2, 4, 5):
        w.experience.answer(w.top, 1, credit, version=3)
    w.experience.answer(w.top, 2, 1)  # arrives after it was given up on: ignored
    got = [w.trainer._next_batch().header.credit for _ in range(3)]
    assert got == [2, 4, 5]  # its credits 1 and 3 were re-granted to maker 0 as 4 and 5, in order
    assert w.credits.to(1) == [0, 2, 4, 5] and all(c.min_version == 3 for _, c in w.credits.sent[-2:])
    assert w.ledger.dead == {1} and w.status.dropped == {1} and w.makers.forgotten == {2}
    assert w.ledger.used == [4 * SAMPLES, 0] and w.ledger.outstanding == [0, 0]


def test_drain_counts_outstanding_as_dropped_and_a_maker_lost_meanwhile_does_not_hang(world):
    w = world()
    w.ledger.grant(4, min_version=0)  # maker 0: 0, 2; maker 1: 1, 3
    w.experience.answer(w.top, 1, 0)
    w.experience.answer(w.top, 2, 1)
    w.experience.answer(w.top, 1, 2)
    threading.Timer(0.1, w.makers.stalled.add, (2,)).start()  # maker 1 never sends credit 3, then stalls
    t0 = time.monotonic()
    assert w.trainer._drain() == 3 * SAMPLES
    assert time.monotonic() - t0 < 1.0
    assert w.ledger.dead == {1} and len(w.credits.sent) == 4  # nothing re-issued during the drain
    assert w.ledger.pending == 0 and w.ledger.used == [2 * SAMPLES, SAMPLES]


def test_every_sample_is_accounted_for(world):
    w = world()
    w.ledger.grant(4, min_version=0)  # maker 0: 0, 2; maker 1: 1, 3
    w.experience.answer(w.top, 1, 0)
    w.experience.answer(w.top, 2, 1)
    consumed = w.trainer._next_batch().header.samples
    stale = w.trainer._next_batch().header.samples  # the trainer drops it as stale
    w.status.counts = {0: 3 * SAMPLES, 1: 2 * SAMPLES}  # maker 1 made credit 3 too, then died with it
    w.makers.stalled.add(2)
    w.trainer._follow_losses(w.ledger.check_peers())  # maker 1 dropped: credit 3 re-issued to maker 0 as 4
    w.experience.answer(w.top, 1, 2)
    w.experience.answer(w.top, 1, 4)
    shutdown = w.trainer._drain()
    w.status.done = {0}
    w.ledger.stop_all()
    assert w.status.finished and w.credits.stopped == [1]  # STOP to the live maker only
    produced = w.ledger.produced(timeout_s=1.0)
    row = closing_row(produced, [float(n) for n in w.ledger.used], w.ledger.dead, consumed, shutdown, stale)
    assert row["lost_in_flight"] == SAMPLES and row["makers_lost"] == 1
    assert row["samples_produced"] == 5 * SAMPLES == consumed + stale + shutdown + row["lost_in_flight"]


def test_a_live_maker_that_never_reports_done_is_named(world):
    w = world()
    w.ledger.stop_all()
    with pytest.raises(PeerLost, match="maker rank 1 did not finish within 1 s of the STOP credit"):
        w.ledger.produced(timeout_s=1.0)


def test_a_frozen_makers_credit_send_never_blocks_and_a_failed_one_drops_its_maker(world):
    w = world()
    w.credits.frozen.add(2)  # maker 1 is frozen: its receive is never posted
    t0 = time.monotonic()
    w.ledger.grant(4, min_version=0)
    w.experience.answer(w.top, 1, 0)
    assert w.trainer._next_batch().header.credit == 0
    assert time.monotonic() - t0 < 0.5 and w.ledger.dead == set()  # its sends are pending, not waited for
    w.credits.works[2][0].done, w.credits.works[2][0].error = True, RuntimeError("connection reset")
    w.experience.answer(w.top, 1, 2)
    assert w.trainer._next_batch().header.credit == 2
    w.trainer._follow_losses(w.ledger.check_peers())
    assert w.ledger.dead == {1} and w.credits.to(1) == [0, 2, 4, 5]  # a failed delivery drops the maker


def test_a_stream_of_garbage_drops_its_maker_and_a_silent_one_is_named(world):
    w = world(timeout_s=0.3)
    w.ledger.grant(2, min_version=0)
    w.experience.queues[2].put(ChannelError("experience header from rank 2 refused: bad"))
    with pytest.raises(PeerLost, match=r"no experience within 0 s from maker rank 1$"):
        w.trainer._next_batch()  # maker 1's credit 1 went to maker 0, which never answers
    assert w.ledger.dead == {1} and w.credits.to(1) == [0, 2]
    w.makers.stalled.add(1)
    with pytest.raises(PeerLost, match="every maker is dead"):
        w.trainer._next_batch()


def test_a_dead_trainer_is_named(world):
    w = world()
    w.trainers.stalled.add(3)
    with pytest.raises(PeerLost, match="trainer rank 3 stopped responding"):
        w.trainer._next_batch()


class Weights:
    """A weight channel whose broadcast cannot complete while ``block`` is set and every maker is alive;
    returns ``unreachable`` as the ranks a point-to-point copy could not reach."""

    def __init__(self, block: bool = False, unreachable: list[int] | None = None, error: BaseException | None = None):
        self.block, self.unreachable, self.error = block, unreachable or [], error
        self.calls: list[tuple[int, list[int]]] = []
        self.ended: list[list[int]] = []
        self.entered = threading.Event()
        self.transport, self.nbytes = "broadcast", 4

    def publish(self, flat, version, makers, alive):
        self.entered.set()
        if self.error is not None:
            raise self.error
        while self.block and alive():
            time.sleep(0.005)
        if self.block:
            self.block, self.transport = False, "point-to-point"
        self.calls.append((version, list(makers)))
        failed, self.unreachable = self.unreachable, []
        return failed

    def end(self, makers, alive):
        self.ended.append(list(makers))


def _wait_for(check, what: str, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _trainer_zero(w, weights: Weights) -> SimpleNamespace:
    """Trainer 0 over ``w``'s ledger: with a started publisher, whose events it keeps."""
    events: list = []
    publisher = Publisher(weights, [w.top.maker_rank(m) for m in range(w.top.makers)], torch.device("cpu"),
                          events.append)
    publisher.start()
    t0 = as_trainer(w.ledger, w.top, publisher)
    t0.events = events
    return t0


def test_a_maker_dropped_during_a_publish_changes_who_the_publisher_sends_to(world):
    w = world()
    weights = Weights(block=True)
    t0 = _trainer_zero(w, weights)
    t0.publisher.post(1, torch.zeros(1))
    assert weights.entered.wait(2.0)  # the broadcast of v1 waits on a maker that froze
    w.ledger.grant(2, min_version=1)  # credit 0 to maker 0 (rank 1), 1 to maker 1 (rank 2)
    w.makers.stalled.add(1)  # maker 0 froze: the ledger drops it at its next look
    for credit in (1, 2):  # maker 0's credit 0 went to maker 1 as credit 2
        w.experience.answer(w.top, 2, credit, version=1)
    assert [t0._next_batch().header.credit for _ in range(2)] == [1, 2]
    _wait_for(lambda: len(weights.calls) == 2, "the republish to the live maker")
    assert weights.calls == [(1, [1, 2]), (1, [2])]  # v1 gave up on the broadcast, then went to the live maker
    assert [e.makers for e in t0.events] == [2, 1] and t0.events[-1].transport == "point-to-point"
    t0.publisher.end()
    _wait_for(lambda: weights.ended, "the end of the weight stream")
    assert weights.ended == [[2]]


def test_an_unreachable_maker_is_reported_and_dropped(world):
    w = world()
    weights = Weights(unreachable=[2])  # maker 1 (rank 2) could not be reached with v1
    t0 = _trainer_zero(w, weights)
    w.ledger.grant(2, min_version=1)  # credit 0 to maker 0, 1 to maker 1
    t0.publisher.post(1, torch.zeros(1))
    _wait_for(lambda: weights.calls, "the publish of v1")
    _wait_for(lambda: t0.publisher._unreachable, "the unreachable maker reported")
    t0._follow_losses()
    assert w.ledger.dead == {1} and w.status.dropped == {1}
    assert w.credits.to(1) == [0, 2]  # its credit re-issued to the live maker
    _wait_for(lambda: len(weights.calls) == 2, "the republish after the drop")
    assert weights.calls == [(1, [1, 2]), (1, [1])]
    assert t0.publisher.unreachable() == []


def test_a_publish_error_is_raised_on_the_main_thread(world):
    w = world()
    weights = Weights(error=RuntimeError("NCCL error"))
    t0 = _trainer_zero(w, weights)
    t0.publisher.post(1, torch.zeros(1))
    _wait_for(lambda: t0.publisher.error is not None, "the publisher thread's error")
    with pytest.raises(PeerLost, match="publishing weights to the makers failed: NCCL error"):
        t0.publisher.post(2, torch.zeros(1))
    with pytest.raises(PeerLost, match="NCCL error"):
        t0.publisher.republish()


def test_the_mailbox_keeps_only_the_newest_version_and_the_end():
    weights = Weights()
    publisher = Publisher(weights, [1], torch.device("cpu"), lambda e: None)
    for v in (1, 2, 3):
        publisher.post(v, torch.zeros(1))
    publisher.end()
    publisher.post(4, torch.zeros(1))  # the end marker stays
    publisher.start()
    _wait_for(lambda: weights.ended, "the end of the weight stream")
    assert weights.calls == []  # not started while they were posted: only the end was left
