"""The ledger's pick rules (:mod:`hpcrl.ppo.credits`), pure: which batch goes next, which credits a lost
maker takes with it, which maker gets the next credit, which trained ids a resume must skip."""

from __future__ import annotations

import torch

from hpcrl.ppo.credits import Credit, Received, lost_with, next_id, next_ready, pick_maker, still_taken
from hpcrl.ppo.wire import Header


def credits(*specs: tuple[int, int, int, bool]) -> dict[int, Credit]:
    """A ledger's credits from (id, maker, version, arrived), in grant order."""
    out = {}
    for cid, maker, version, arrived in specs:
        batch = Received(Header(maker, cid, 0, version, 8, 1), torch.zeros(1)) if arrived else None
        out[cid] = Credit(cid, maker, version, sent=(None, None), batch=batch)
    return out


def test_at_one_version_the_oldest_credit_goes_first_and_is_waited_for():
    assert next_ready({}) is None
    assert next_ready(credits((0, 0, 3, True), (1, 1, 3, True))) == 0
    assert next_ready(credits((0, 0, 3, False), (1, 1, 3, True), (2, 0, 3, True))) is None  # --lag 0 stays exact


def test_across_versions_the_oldest_arrived_batch_goes_ahead_of_a_missing_one():
    assert next_ready(credits((4, 0, 1, False), (5, 1, 2, False), (6, 1, 2, True), (7, 0, 2, True))) == 6
    assert next_ready(credits((4, 0, 1, False), (5, 1, 2, False))) is None  # nothing here yet


def test_a_lost_maker_takes_only_its_credits_whose_batch_has_not_arrived():
    held = credits((0, 0, 1, False), (1, 1, 1, True), (2, 1, 1, False), (3, 0, 1, True), (4, 1, 2, False))
    assert lost_with(held, 1) == [2, 4]  # its arrived batch (credit 1) is still handed out
    assert lost_with(held, 0) == [0]
    assert lost_with(held, 2) == []


def test_a_credit_goes_to_the_maker_with_the_fewest_in_flight_the_rotation_deciding_among_equals():
    assert pick_maker([0, 1, 2], {}, cursor=0) == (0, 1)
    assert pick_maker([0, 1, 2], {}, cursor=1) == (1, 2)
    assert pick_maker([0, 1, 2], {}, cursor=5) == (2, 3)  # the cursor wraps
    busy = credits((0, 0, 1, False), (1, 1, 1, False), (2, 1, 1, True))  # an arrived batch is not in flight
    assert pick_maker([0, 1, 2], busy, cursor=0) == (2, 3)
    assert pick_maker([0, 1], busy, cursor=1) == (1, 2)  # one in flight each: the rotation decides
    assert pick_maker([0, 2], credits((0, 1, 1, False)), cursor=1) == (2, 2)  # another trainer's maker ignored


def test_trained_ids_are_skipped_and_forgotten_once_behind_the_oldest_untrained():
    assert next_id(5, {6, 8}) == 5 and next_id(6, {6, 7, 9}) == 8
    assert still_taken({6, 8, 12}, first_untrained=9, next_credit=11) == {12}  # 12: not granted yet
    assert still_taken({6, 8}, first_untrained=5, next_credit=9) == {6, 8}
    assert still_taken(set(), first_untrained=0, next_credit=0) == set()
