"""The progress display's text, as pure functions (no I/O, no clock; the closing lines read the working
directory unless given one): :class:`hpcrl.run.metrics.RunLogger` prints what these return.

A progress line is a list of ``name=value`` fields in priority order (progress, eval return, the last
known episode return and its age, throughput, ETA, then the row's other values). On a terminal the
line is cut to its width by dropping whole fields, never by cutting a value in half; in a file or a
Slurm log (``width=None``) every field is kept.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping

__all__ = ["duration", "value", "fit", "progress_fields", "recent_rate", "summary_lines", "short_path",
           "early_stop_line", "LOG_WIDTH"]

# Files and Slurm logs get lines this wide at most: the leading fields, then whatever else fits
# (metrics.jsonl holds every value; a log line is for reading).
LOG_WIDTH = 160

# Row keys the leading fields already show (or that mean nothing on screen).
_SHOWN = {"time", "sps", "episode_return", "eval_return"}


def duration(seconds: float) -> str:
    """``45s``, ``1m02s``, ``2h05m``; ``?`` for an unknown (non-finite or negative) duration."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def value(v: Any) -> str:
    """A row value for the screen: floats to 4 significant digits, missing values (None, NaN) as ``-``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def fit(fields: Iterable[str], width: int | None) -> str:
    """Join ``fields`` with spaces; with a ``width``, skip every field that would overflow it (a later,
    shorter field may still fit). The first field is always kept (cut only if it alone is too wide)."""
    fields = list(fields)
    if width is None or not fields:
        return " ".join(fields)
    line = fields[0][:width]
    for f in fields[1:]:
        if len(line) + 1 + len(f) <= width:
            line += " " + f
    return line


def progress_fields(row: Mapping[str, Any], *, key: str, total: int, elapsed_s: float,
                    rate: float | None = None, last_return: float | None = None, return_age: int = 0) -> list[str]:
    """The fields of one progress line, most important first.

    ``key`` is the row field that runs from 0 to ``total`` (``env_steps`` for FastSAC, ``updates``
    for PPO). ``last_return`` is the newest finite ``episode_return`` seen so far and ``return_age``
    how many rows ago it was logged (0: this row), so a window in which no episode ended shows the
    last known return instead of nothing. ``rate`` (``key`` units per second, measured by the caller
    over this process's rows: a resumed run's earlier steps are not its speed) gives the ETA.
    """
    done = row.get(key, 0) or 0
    pct = 100.0 * done / max(total, 1)
    fields = [f"[{pct:5.1f}%]", f"{key}={value(done)}/{total}"]
    if row.get("eval_return") is not None and not _nan(row.get("eval_return")):
        fields.append(f"eval_return={value(row['eval_return'])}")
    if last_return is not None:
        age = "" if return_age == 0 else f" ({return_age} row{'s' if return_age != 1 else ''} ago)"
        fields.append(f"return={value(last_return)}{age}")
    if row.get("sps") is not None:
        fields.append(f"sps={value(row['sps'])}")
    if rate is not None and rate > 0 and done < total:
        fields.append(f"eta={duration((total - done) / rate)}")
    fields.append(f"elapsed={duration(elapsed_s)}")
    for k, v in row.items():  # a value missing from this row (no episode ended: NaN) says nothing
        if k not in _SHOWN and k != key and v is not None and not _nan(v):
            fields.append(f"{k}={value(v)}")
    return fields


def recent_rate(points: "list[tuple[float, float]]") -> float | None:
    """Progress units per second over ``points`` = [(time, progress value), ...] oldest first: the
    rate of the recent rows, so an ETA measured during fast warm-up (random steps, no updates) is
    replaced by the training speed once it begins. None until two points differ."""
    if len(points) < 2:
        return None
    (t0, v0), (t1, v1) = points[0], points[-1]
    return (v1 - v0) / (t1 - t0) if t1 > t0 and v1 > v0 else None


def summary_lines(elapsed_s: float, results: Mapping[str, Any], paths: Mapping[str, Any], *,
                  stopped: str | None = None, cwd: str | None = None) -> list[str]:
    """The last lines of a run: ``done in 1m02s: eval_return=-198.3`` (``stopped (SIGTERM) after 2s:
    ...; resume with --resume`` for an interrupted run), then one line per place, ``checkpoint DIR``,
    ``metrics FILE``, so each fits a terminal and no path is ever cut. ``results`` are values
    (None/NaN skipped), ``paths`` where things are (empty ones skipped), shown relative to ``cwd``
    (default: the working directory) where that is shorter."""
    parts = [f"{k}={value(v)}" for k, v in results.items() if v is not None and not _nan(v)]
    head = (f"stopped ({stopped}) after {duration(elapsed_s)}" if stopped else f"done in {duration(elapsed_s)}")
    head += (": " + ", ".join(parts) if parts else "") + ("; resume with --resume" if stopped else "")
    base = os.getcwd() if cwd is None else cwd
    return [head, *(f"{k} {short_path(p, base)}" for k, p in paths.items() if p)]


def short_path(path: Any, cwd: str) -> str:
    """``path`` relative to ``cwd`` where that is shorter (``runs/p/metrics.jsonl``), else as given."""
    text = str(path)
    try:
        rel = os.path.relpath(os.path.join(cwd, text), cwd)
    except ValueError:  # another drive (Windows)
        return text
    return rel if len(rel) < len(text) else text


def early_stop_line(reason: str, *, key: str, at: Any, total: int, elapsed_s: float) -> str:
    """``stopped early at updates=40/100 after 12s: episode_return_recent 480.2 >= --target-return 475``."""
    return f"stopped early at {key}={value(at)}/{total} after {duration(elapsed_s)}: {reason}"


def _nan(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)
