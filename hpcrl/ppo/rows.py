"""A detached-PPO trainer's metrics rows: what one step measured, its reduced row, the run's closing accounts.

Plain functions and one small dataclass of running counts; the trainer does the reduction over its
plane (:func:`hpcrl.comm.reduce_metrics` with :data:`STEP_SUMS` / ``lag_max`` / ``lag_min``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["MIN_RECENT_EPISODES", "STEP_SUMS", "Tally", "add_stats", "closing_row", "step_metrics"]

MIN_RECENT_EPISODES = 20  # episode_return_recent: mean over the latest steps that finished this many
# the step metrics summed over the trainers; lag_max is a max, lag_min a min, the learner's stats a mean
STEP_SUMS = ["samples", "return_sum", "episodes", "lag_sum", "batches", "dropped_stale", "maker_wait_s",
             "maker_busy_s"]
MAKER_TIME = ("maker_wait_s", "maker_busy_s")  # counted for stale batches too: the makers' time was spent


def add_stats(total: dict[str, float], stats: dict[str, float], keys: tuple[str, ...] | None = None) -> None:
    """``total += stats`` per key (``keys``: only these, missing ones as 0)."""
    for k, v in (stats.items() if keys is None else ((k, stats.get(k, 0.0)) for k in keys)):
        total[k] = total.get(k, 0.0) + v


def step_metrics(stats: dict[str, float], lags: list[int], wait_s: float, step_s: float, dropped_stale: float,
                 learn: dict[str, float]) -> dict[str, float]:
    """One trainer's step, before the reduction: the batches' summed rollout ``stats``, their ``lags``,
    the time waited for them, the step's duration, the run's stale drops so far and the update's stats."""
    return {"samples": stats.get("env_steps", 0.0), "return_sum": stats.get("episode_return_sum", 0.0),
            "episodes": stats.get("episodes", 0.0), "lag_sum": float(sum(lags)), "batches": float(len(lags)),
            "lag_max": float(max(lags)), "lag_min": float(min(lags)), "idle_frac": wait_s / step_s,
            "dropped_stale": dropped_stale, "maker_wait_s": stats.get("maker_wait_s", 0.0),
            "maker_busy_s": stats.get("maker_busy_s", 0.0), **{f"learn/{k}": v for k, v in learn.items()}}


@dataclass
class Tally:
    """A trainer's running counts: env steps (reduced), stale drops (its own), the latest steps'
    returns for episode_return_recent, and the best of it so far (for the closing line)."""

    env_steps: float
    resumed_env_steps: float
    dropped_stale: float = 0.0
    best: float = float("nan")
    recent: deque[tuple[float, float]] = field(default_factory=deque)  # (return sum, episodes) per step

    def row(self, reduced: dict[str, float], version: int, publish_ms: float, step_s: float) -> dict[str, float]:
        """The logged row of a step from its reduced metrics (every trainer computes the same one)."""
        self.env_steps += reduced["samples"]
        recent_return = self._recent(reduced["return_sum"], reduced["episodes"])
        if recent_return == recent_return:  # not NaN
            self.best = recent_return if self.best != self.best else max(self.best, recent_return)
        row = {"env_steps": int(self.env_steps), "updates": version, "policy_version": version,
               "episode_return": (reduced["return_sum"] / reduced["episodes"] if reduced["episodes"]
                                  else float("nan")),
               "episode_return_recent": recent_return,
               "lag_mean": reduced["lag_sum"] / reduced["batches"], "lag_max": reduced["lag_max"],
               "lag_min": reduced["lag_min"], "dropped_stale": reduced["dropped_stale"],
               "weight_publish_ms": publish_ms, "samples_per_s": reduced["samples"] / step_s,
               "trainer_idle_frac": reduced["idle_frac"],
               # of the makers' time behind this step's batches, the share not spent collecting
               "maker_idle_frac": (reduced["maker_wait_s"]
                                   / max(reduced["maker_wait_s"] + reduced["maker_busy_s"], 1e-9)),
               **{k.removeprefix("learn/"): v for k, v in reduced.items() if k.startswith("learn/")}}
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}

    def _recent(self, return_sum: float, episodes: float) -> float:
        self.recent.append((return_sum, episodes))
        while len(self.recent) > 1 and sum(n for _, n in self.recent) - self.recent[0][1] >= MIN_RECENT_EPISODES:
            self.recent.popleft()
        count = sum(n for _, n in self.recent)
        return sum(r for r, _ in self.recent) / count if count >= MIN_RECENT_EPISODES else float("nan")


def closing_row(produced: list[float], used: list[float], lost: set[int], consumed: float, dropped_shutdown: float,
                dropped_stale: float) -> dict[str, float]:
    """The run's sample accounts: every sample the makers ``produced`` was consumed, dropped as stale,
    dropped at shutdown, or died with a ``lost`` maker (what it made and no trainer ``used``: lost in
    flight), so produced = consumed + stale + shutdown + lost in flight."""
    in_flight = 0.0
    for m in sorted(lost):
        in_flight += produced[m] - used[m]
    return {"samples_produced": sum(produced, 0.0), "samples_consumed": consumed, "dropped_shutdown": dropped_shutdown,
            "dropped_stale": dropped_stale, "lost_in_flight": in_flight, "makers_lost": float(len(lost))}
