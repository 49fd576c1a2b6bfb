"""Environments, tools and rewards the multi-turn tests name by ``module:attribute`` (``--hf.env``,
``--hf.tools``, ``--hf.reward-fn``): importable from ``tests/`` by makers, trainers and tool workers alike."""

from __future__ import annotations

import time
from typing import Any

OBSERVATIONS = ("red blue", "cat")
TURN_REWARDS = (0.5, 0.25, 1.0)


class Scripted:
    """Three turns whatever the policy says: observations :data:`OBSERVATIONS`, rewards :data:`TURN_REWARDS`."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record, self.turn = record, 0

    def reset(self) -> str:
        return self.record["prompt"]

    def step(self, response: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        if self.turn < 3:
            return OBSERVATIONS[self.turn - 1], TURN_REWARDS[self.turn - 1], False
        return None, TURN_REWARDS[2], True


class UntilYes:
    """Goes on (observation "no") until the policy says "yes" (reward 1) or the turns run out (reward 0)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def reset(self) -> str:
        return self.record["prompt"]

    def step(self, response: str) -> tuple[str | None, float, bool]:
        if "yes" in response.split():
            return None, 1.0, True
        return "no", 0.0, False


class RaisesOnSecond(Scripted):
    def step(self, response: str):
        if self.turn == 1:
            raise ValueError("second step broke")
        return super().step(response)


class WrongTypes(Scripted):
    def step(self, response: str):
        return "red", "1.0", False


class SleepsOnSecond(Scripted):
    def step(self, response: str):
        if self.turn == 1:
            time.sleep(30)
        return super().step(response)


class NoStep:
    def __init__(self, record: dict[str, Any]) -> None:
        pass

    def reset(self) -> str:
        return "red"


class ResetsToNumber(Scripted):
    def reset(self):
        return 42


def add(argument: str) -> str:
    a, b = argument.split()
    return str(int(a) + int(b))


def slow(argument: str) -> str:
    time.sleep(60)
    return "late"


def boom(argument: str) -> str:
    raise RuntimeError("the tool broke")


def says_seven(records: list[dict[str, Any]], responses: list[str]) -> list[float]:
    return [float(r.split()[-1:] == ["7"]) for r in responses]


class LoggedUntilYes(UntilYes):
    """:class:`UntilYes` that appends ``{"pid", "id", "turn"}`` of every reset and step to the file named by
    ``HPCRL_TEST_EPISODE_LOG`` (which records each maker played, in which order)."""

    def reset(self) -> str:
        self._log("reset")
        return super().reset()

    def step(self, response: str):
        self._log("step")
        return super().step(response)

    def _log(self, what: str) -> None:
        import json
        import os

        path = os.environ.get("HPCRL_TEST_EPISODE_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "id": self.record["id"], "what": what}) + "\n")


class LongObservation(Scripted):
    """Answers the first turn with an observation longer than any episode budget the tests use."""

    def step(self, response: str):
        self.turn += 1
        return " ".join(["red"] * 80), 0.0, False


class SlowForRecordZero(Scripted):
    """:class:`Scripted` whose first step sleeps 1.5 s for the record with id 0 (the others answer at once)."""

    def step(self, response: str):
        if self.turn == 0 and self.record["id"] == 0:
            time.sleep(1.5)
        return super().step(response)
