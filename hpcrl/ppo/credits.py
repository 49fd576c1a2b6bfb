"""A trainer's credits: one record per credit, and the rules :class:`~hpcrl.ppo.ledger.MakerLedger` picks by.

The rules are pure: they read a ledger's credits (credit id -> :class:`Credit`, in grant order, so in
order of required version: a credit granted later requires the same version or a newer one) and
change nothing. Which batch goes next (:func:`next_ready`), which credits a lost maker takes with it
(:func:`lost_with`), which maker gets the next credit (:func:`pick_maker`), and which credit ids were
trained already (:func:`next_id`, :func:`still_taken`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .wire import Header

__all__ = ["Credit", "Received", "lost_with", "next_id", "next_ready", "pick_maker", "still_taken"]


@dataclass
class Received:
    """One batch of experience off the wire: its header and packed payload."""

    header: Header
    payload: torch.Tensor


@dataclass
class Credit:
    """A credit granted and not handed out yet."""

    id: int
    maker: int
    """The maker (index) it was granted to."""
    version: int
    """The policy version it requires."""
    sent: tuple
    """Its posted send (work, message): settled once its batch is handed out."""
    batch: Received | None = None
    """Its batch, once arrived."""

    @property
    def arrived(self) -> bool:
        return self.batch is not None


def next_ready(credits: Mapping[int, Credit]) -> int | None:
    """The credit whose batch goes next, if it is here: the oldest outstanding one; or, while the
    outstanding credits span versions, the oldest that has arrived (see :mod:`hpcrl.ppo.ledger`)."""
    if not credits:
        return None
    head = next(iter(credits.values()))
    if head.arrived:
        return head.id
    if head.version == next(reversed(credits.values())).version:
        return None  # one version outstanding (--lag 0): credit order keeps a step's batches as they are
    return next((c.id for c in credits.values() if c.arrived), None)


def lost_with(credits: Mapping[int, Credit], maker: int) -> list[int]:
    """The credits lost with ``maker``: its credits whose batch has not arrived (an arrived batch is
    still handed out)."""
    return [c.id for c in credits.values() if c.maker == maker and not c.arrived]


def pick_maker(mine: list[int], credits: Mapping[int, Credit], cursor: int) -> tuple[int, int]:
    """The maker of ``mine`` that gets the next credit, and the rotation's next cursor: the maker with
    the fewest credits whose batch has not arrived, the rotation from ``cursor`` deciding among equals
    (``min`` keeps the first of equals in rotation order)."""
    in_flight = dict.fromkeys(mine, 0)
    for c in credits.values():
        if not c.arrived and c.maker in in_flight:
            in_flight[c.maker] += 1
    start = cursor % len(mine)
    m = min(mine[start:] + mine[:start], key=in_flight.__getitem__)
    return m, mine.index(m) + 1


def next_id(credit: int, taken: set[int]) -> int:
    """The first credit id from ``credit`` on that was not trained already."""
    while credit in taken:
        credit += 1
    return credit


def still_taken(taken: set[int], first_untrained: int, next_credit: int) -> set[int]:
    """The trained ids worth remembering: those after the oldest untrained credit (a resume starts
    there), or not reached by the numbering yet (never granted)."""
    return {c for c in taken if c > first_untrained or c >= next_credit}
