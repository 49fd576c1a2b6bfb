"""The ledger's hand-out order (:mod:`hpcrl.ppo.ledger`), over the fake channels of test_ppo_makers.py.

At one outstanding version (``--lag 0``) batches go in credit order (tested there); once the outstanding
credits span versions, a frozen maker's credit no longer holds up batches that have arrived, new credits
go to the maker with the fewest in flight, and what went ahead is remembered so a resume collects it
once only."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_ppo_makers import world  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.timeout(10)


def test_across_versions_an_arrived_batch_goes_ahead_of_a_frozen_makers_credit(world):  # noqa: F811
    w = world()
    w.ledger.grant(1, min_version=0)  # credit 0 to maker 0 (rank 1), which froze
    w.ledger.grant(1, min_version=1)  # credit 1 to maker 1 (rank 2): maker 0 has one in flight
    assert w.credits.to(1) == [0] and w.credits.to(2) == [1]
    w.experience.answer(w.top, 2, 1, version=1)
    t0 = time.monotonic()
    assert w.trainer._next_batch().header.credit == 1  # not held up by credit 0
    assert time.monotonic() - t0 < 0.5
    assert w.ledger.first_untrained == 0 and w.ledger.taken_ahead == [1]
    w.ledger.grant(1, min_version=2)  # to the maker with nothing in flight: maker 1 again
    assert w.credits.to(2) == [1, 2]
    w.experience.answer(w.top, 2, 2, version=2)
    assert w.trainer._next_batch().header.credit == 2 and w.ledger.taken_ahead == [1, 2]
    w.experience.answer(w.top, 1, 0)  # maker 0 woke in time
    assert w.trainer._next_batch().header.credit == 0
    assert w.ledger.first_untrained == 3 and w.ledger.taken_ahead == []
    assert w.ledger.outstanding == [0, 0] and w.ledger.dead == set()


def test_a_resume_does_not_collect_the_credits_taken_ahead_again(world):  # noqa: F811
    w = world()
    w.ledger.resume(5, taken_ahead=[6, 8])  # a checkpoint taken while credit 5 was outstanding, 6 and 8 trained
    w.ledger.grant(4, min_version=3)
    assert sorted(c.credit_id for _, c in w.credits.sent) == [5, 7, 9, 10]
    assert w.ledger.first_untrained == 5 and w.ledger.taken_ahead == [6, 8]  # a checkpoint now keeps them
    for credit, rank in ((5, 1), (7, 2), (9, 1), (10, 2)):
        w.experience.answer(w.top, rank, credit, version=3)
    assert [w.trainer._next_batch().header.credit for _ in range(4)] == [5, 7, 9, 10]
    assert w.ledger.first_untrained == 11 and w.ledger.taken_ahead == []
