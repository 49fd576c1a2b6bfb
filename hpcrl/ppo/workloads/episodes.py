"""Text episodes: the environment protocol of multi-turn ``hf`` runs (``--hf.env pkg.mod:Factory``).

A factory gets one dataset record (a dict, every field) and returns an :class:`Episode`::

    class Episode(Protocol):
        def reset(self) -> Observation: ...           # the first observation: the prompt
        def step(self, response: str) -> tuple[Observation | None, float, bool]: ...

An observation is text, or chat messages (``[{"role": ..., "content": ...}]``, rendered with the tokenizer's
chat template). ``step`` gets the policy's response to the conversation so far (decoded, special tokens
dropped) and returns what the policy sees next (None when nothing), the turn's reward and whether the
episode is over; it may return a fourth item, a dict with counts the rows report (``tool_calls``,
``tool_errors``). The maker runs a batch of episodes turn by turn (:mod:`.rollout`); a plain
``--hf.reward-fn`` is the one-turn case of the same path, scored at the end.

Anything a user's episode does wrong mid-run (``step`` raises, returns the wrong types, takes longer than
``--hf.step-timeout-s``) ends that episode with the reason logged once and counted in the rows; the run
goes on. What can be known before ranks start (a factory that does not import, a first observation of
the wrong type) is refused then, in one line.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

from hpcrl.core.config_check import ConfigError

__all__ = ["Done", "Episode", "EpisodeFactory", "Message", "Observation", "Outcome", "Pending", "check_observation",
           "checked", "import_factory", "launch", "wait_ready"]

Message = dict[str, str]
Observation = Union[str, list[Message]]
FLAG = "--hf.env"


class Episode(Protocol):
    """One text episode (see the module's docstring)."""

    def reset(self) -> Observation: ...

    def step(self, response: str) -> tuple[Any, ...]: ...


EpisodeFactory = Callable[[dict[str, Any]], Episode]


@dataclass(frozen=True)
class Outcome:
    """One checked step: what comes next, the turn's reward, whether it ended, the counts it reported, and
    ``error``: why the maker ended the episode (None: it ended, or goes on, as the episode said)."""

    observation: Observation | None
    reward: float
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None

    @classmethod
    def failed(cls, why: str) -> Outcome:
        return cls(None, 0.0, True, error=why)


def check_observation(obs: Any) -> str | None:
    """Why ``obs`` is not an observation (text, or a list of ``{role, content}`` string dicts), or None."""
    if isinstance(obs, str):
        return None
    if isinstance(obs, list) and obs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs):
        return None
    return f"an observation must be a str or a non-empty list of {{'role': str, 'content': str}}, not {_kind(obs)}"


def checked(result: Any) -> Outcome:
    """``step``'s return value as an :class:`Outcome`, or a failed one naming what was wrong with it."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        return Outcome.failed(f"step returned {_kind(result)}; return (observation | None, reward, done)")
    obs, reward, done = result[:3]
    info = result[3] if len(result) == 4 else {}
    if obs is not None and (why := check_observation(obs)):
        return Outcome.failed(f"step's {why}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
        return Outcome.failed(f"step's reward is {_kind(reward)}; return a finite float")
    if not isinstance(done, bool):
        return Outcome.failed(f"step's done is {_kind(done)}; return True or False")
    if not isinstance(info, Mapping):
        return Outcome.failed(f"step's fourth item is {_kind(info)}; return a dict (tool_calls, tool_errors)")
    counts = [info.get(k, 0) for k in ("tool_calls", "tool_errors")]
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        return Outcome.failed("step's tool_calls / tool_errors must be integers >= 0")
    return Outcome(obs, float(reward), done or obs is None, *counts)


def _kind(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def import_factory(spec: str, flag: str = FLAG) -> EpisodeFactory:
    """The callable ``spec`` (``package.module:Factory``) names, or a one-line :class:`ConfigError`."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{flag} {spec}: must be package.module:Factory; e.g. {flag} mypkg.envs:Calculator")
    try:
        factory = getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ConfigError(f"{flag} {spec}: cannot import {module!r} ({type(err).__name__}: {err}); put its package "
                          "on PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"{flag} {spec}: module {module!r} has no {name!r}; name a callable record -> episode") \
            from None
    if not callable(factory):
        raise ConfigError(f"{flag} {spec}: {type(factory).__name__} is not callable; name a class or function "
                          "taking a dataset record and returning an episode with reset() and step(response)")
    return factory


def probe(factory: EpisodeFactory, record: dict[str, Any], spec: str, flag: str = FLAG) -> None:
    """Before any rank starts: the factory builds an episode of the first record, which resets to an
    observation. Its steps cannot be probed (they need the policy's responses)."""
    try:
        episode = factory(dict(record))
        for hook in ("reset", "step"):
            if not callable(getattr(episode, hook, None)):
                raise ConfigError(f"{flag} {spec}: what it returned ({type(episode).__name__}) has no {hook}() method; "
                                  "return an object with reset() and step(response)")
        first = episode.reset()
    except ConfigError:
        raise
    except Exception as err:  # the user's code: report it, whatever it raised
        raise ConfigError(f"{flag} {spec}: building and resetting the episode of record 0 raised "
                          f"{type(err).__name__}: {err}") from None
    if why := check_observation(first):
        raise ConfigError(f"{flag} {spec}: reset() of record 0 returned {_kind(first)}; {why}")


class Pending:
    """One episode's step, running in a daemon thread of its own from :func:`launch` on (so a tool that
    blocks holds only its episode): :meth:`ready` once it returned or its deadline passed; :meth:`outcome`
    then. A step still running at its deadline is abandoned (a thread cannot be stopped; the daemon flag
    keeps it from holding the process at exit) and its episode ends."""

    def __init__(self, call: Callable[[], Any], timeout_s: float, wake: threading.Condition) -> None:
        self.timeout_s, self.wake = timeout_s, wake
        self.deadline = time.monotonic() + timeout_s
        self._result: Outcome | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True, name="episode-step")
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            result = checked(call())
        except Exception as err:  # the user's step: its episode ends, the run goes on
            result = Outcome.failed(f"step raised {type(err).__name__}: {err}")
        with self.wake:
            self._result = result
            self.wake.notify_all()

    def ready(self) -> bool:
        return self._result is not None or time.monotonic() >= self.deadline

    def outcome(self) -> Outcome:
        if self._result is not None:
            return self._result
        return Outcome.failed(f"step took longer than --hf.step-timeout-s {self.timeout_s:g}")


class Done(Pending):
    """A step with its outcome known at once (no thread)."""

    def __init__(self, outcome: Outcome) -> None:
        self._result, self.deadline = outcome, 0.0


def launch(calls: list[Callable[[], Any]], timeout_s: float, wake: threading.Condition) -> list[Pending]:
    """Every call started at once, each bounded by ``timeout_s``; ``wake`` is notified as each returns."""
    return [Pending(call, timeout_s, wake) for call in calls]


def wait_ready(pending: dict[int, Pending], wake: threading.Condition, wait_s: float) -> list[int]:
    """The keys of the ``pending`` steps that are ready: as soon as all are, else once ``wait_s`` has passed
    and one is (a step that is never ready by itself is at its deadline)."""
    until = time.monotonic() + wait_s
    with wake:
        while True:
            done = [i for i, p in pending.items() if p.ready()]
            now = time.monotonic()
            if len(done) == len(pending) or (done and now >= until):
                return done
            times = [p.deadline for i, p in pending.items() if i not in done] + ([until] if now < until else [])
            wake.wait(max(0.0, min(min(times) - now, 1.0)))
