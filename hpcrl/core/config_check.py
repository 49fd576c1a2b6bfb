"""Range checks of typed configs, shared by every CLI's ``check()``: one line per failure naming the
flag, the bad value, the valid range and a value that works. (A small common module: ``hpcrl.sac``
and ``hpcrl.ppo`` never import each other.)"""

from __future__ import annotations

import math
import re
import shlex
import unicodedata
from typing import Any

__all__ = ["Check", "ConfigError", "DEVICE", "MAX_SEED", "MAX_TIMEOUT_S", "RunDirError", "flag", "show"]

MAX_SEED = 2**31 - 1
"""Seeds are offset per rank and env (``seed * 1_000_003 + rank``, ``seed + rank * envs``): kept in int32."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: longer is a hang, not a timeout (and ``timedelta`` overflows on inf)."""
DEVICE = re.compile(r"auto|cpu|cuda(?::\d+)?")


class ConfigError(ValueError):
    """A configuration that cannot run; the message (one line) says what to change. The entry points
    exit 2 on it."""


class DataError(RuntimeError):
    """The run's data is unusable (e.g. the env returned NaN/inf); the message (one line) names what and
    where. Not a configuration error: the entry points exit 65 (sysexits EX_DATAERR) on it."""


class RunDirError(ValueError):
    """The run directory cannot be used as asked (in use, another run's checkpoint, nothing to resume,
    no usable checkpoint); the message says what to do. Entry points exit 2 on it."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def show(value: Any) -> str:
    """A value as one would type it after its flag (one line whatever it holds)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, (bool, int, float)) or value is None:
        return str(value)
    return repr(value)


class Check:
    """Range checks of one config; each failure is one line: flag, value, range, a value that works."""

    def __init__(self, cfg: Any, defaults: Any = None, source: str = "the default") -> None:
        """``defaults``: where a suggested value comes from (default ``type(cfg)()``), named ``source``
        in the message (e.g. a preset's values: a fix that works with the preset in use)."""
        self.cfg, self.defaults, self.source = cfg, type(cfg)() if defaults is None else defaults, source

    def fail(self, name: str, rule: str, fix: str | None = None) -> None:
        if fix is None:
            fix = f"e.g. {flag(name)} {_example(getattr(self.defaults, name))} ({self.source})"
        raise ConfigError(f"{flag(name)} {show(getattr(self.cfg, name))}: must be {rule}; {fix}")

    def integer(self, name: str, lo: int | None = None, hi: int | None = None, hint: str = "",
                fix: str | None = None) -> None:
        value = getattr(self.cfg, name)
        rule = (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}") if lo is not None else "an integer"
        rule += f" ({hint})" if hint else ""
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(name, f"an integer {rule}" if lo is not None else rule, fix)
        if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
            self.fail(name, rule, fix)

    def real(self, name: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
             hi_open: bool = False, hint: str = "", fix: str | None = None) -> None:
        value = getattr(self.cfg, name)
        if lo is not None and hi is not None:
            rule = f"in {'(' if lo_open else '['}{show(lo)}, {show(hi)}{')' if hi_open else ']'}"
        elif lo is not None:
            rule = f"{'>' if lo_open else '>='} {show(lo)} and finite"
        else:
            rule = "a finite number"
        rule += f" ({hint})" if hint else ""
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            self.fail(name, rule, fix)  # NaN and +-inf end here, before any comparison
        low_ok = lo is None or (value > lo if lo_open else value >= lo)
        high_ok = hi is None or (value < hi if hi_open else value <= hi)
        if not (low_ok and high_ok):
            self.fail(name, rule, fix)

    def boolean(self, name: str) -> None:
        if not isinstance(getattr(self.cfg, name), bool):
            self.fail(name, "True or False", f"pass {flag(name)} or --no-{flag(name)[2:]}")

    def text(self, name: str, *, spaces: bool = True) -> None:
        value = getattr(self.cfg, name)
        bad = "control characters" + ("" if spaces else " or whitespace")
        if not isinstance(value, str) or not value.strip():
            self.fail(name, "a non-empty string")
        if any(_control(ch) or (not spaces and ch.isspace()) for ch in value):
            self.fail(name, f"free of {bad}")

    def choice(self, name: str, valid: Any, choices: str) -> None:
        value = getattr(self.cfg, name)
        if not isinstance(value, str) or not valid(value):
            self.fail(name, f"one of {choices}")

    def ordered(self, low: str, high: str, what: str) -> None:
        lo, hi = getattr(self.cfg, low), getattr(self.cfg, high)
        if not lo < hi:
            d_lo, d_hi = getattr(self.defaults, low), getattr(self.defaults, high)
            raise ConfigError(f"{flag(low)} {show(lo)} {flag(high)} {show(hi)}: must be "
                             f"{flag(low)} < {flag(high)} ({what}); "
                             f"e.g. {flag(low)} {show(d_lo)} {flag(high)} {show(d_hi)} ({self.source})")


def _example(value: Any) -> str:
    return shlex.quote(value) if isinstance(value, str) else show(value)


def _control(ch: str) -> bool:
    """Control, format, surrogate, private-use or unassigned characters, line and paragraph separators
    (newline, NUL, ESC, U+2028, ...)."""
    return unicodedata.category(ch).startswith(("C", "Zl", "Zp"))
