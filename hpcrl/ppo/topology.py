"""Who is who in a detached-PPO world, and who talks to whom.

Ranks ``[0, T)`` are trainers, ``[T, T + M)`` makers (maker index ``m`` = rank ``T + m``).
Routing (the modulo rule): maker ``m`` and trainer ``t`` are linked iff ``m % T == t % M``.
Every maker gets at least one trainer and every trainer at least one maker for any M, T >= 1:

* M >= T: trainer t serves makers t, t + T, t + 2T, ... (3 makers : 2 trainers -> {0, 2}, {1});
* M <  T: maker m feeds trainers m, m + M, ... (1 maker : 2 trainers -> maker 0 feeds both).

Links decide where a trainer sends credits (and so where experience flows); all trainers consume
the same number of batches per step regardless of how many makers they have, so no trainer waits
on a collective the others never reach. When makers die, the rule is re-applied to the live ones.
Trainer 0 publishes weights to every maker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    trainers: int
    makers: int

    def __post_init__(self) -> None:
        if self.trainers < 1 or self.makers < 1:
            raise ValueError(f"detached PPO needs >= 1 trainer and >= 1 maker, got trainers={self.trainers}, "
                             f"makers={self.makers}")

    @property
    def world_size(self) -> int:
        return self.trainers + self.makers

    def maker_rank(self, m: int) -> int:
        return self.trainers + m

    def maker_index(self, rank: int) -> int:
        return rank - self.trainers

    def makers_of(self, trainer: int, live: list[int] | None = None) -> list[int]:
        """Maker indices linked to ``trainer`` among ``live`` makers (default: all)."""
        live = list(range(self.makers)) if live is None else sorted(live)
        if not live:
            return []
        n = len(live)
        return [live[i] for i in range(n) if i % self.trainers == trainer % n]
