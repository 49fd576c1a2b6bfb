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

__all__ = ["Episode", "EpisodeFactory", "Message", "Observation", "Outcome", "check_observation", "checked",
           "import_factory", "step_bounded"]

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


def step_bounded(calls: list[Callable[[], Any]], timeout_s: float) -> list[Outcome]:
    """Run every episode's step at once, each in a daemon thread of its own (a tool that blocks holds only
    its episode), and wait at most ``timeout_s`` for all: one still running then is abandoned (a thread
    cannot be stopped; the daemon flag keeps it from holding the process at exit) and its episode ends."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as err:  # the user's step: its episode ends, the run goes on
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"episode-step-{i}")
               for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = []
    for t, result, err in zip(threads, results, errors):
        if t.is_alive():
            out.append(Outcome.failed(f"step took longer than --hf.step-timeout-s {timeout_s:g}"))
        elif err is not None:
            out.append(Outcome.failed(f"step raised {type(err).__name__}: {err}"))
        else:
            out.append(checked(result))
    return out
