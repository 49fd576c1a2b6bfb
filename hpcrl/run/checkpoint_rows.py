"""The metrics rows a checkpoint carries, so that a resume never loses the row at the checkpoint's step.

A row is logged (``metrics.jsonl``, line-buffered, not fsynced) before the checkpoint of its step is
written (fsynced); a torn or lost last line would otherwise be dropped on resume and never logged
again, since the resumed run starts after that step. Rank 0 copies the rows of the latest logged
step (the training row and an eval row of the same step) into the checkpoint as ``rows.jsonl``
(in its manifest); :func:`hpcrl.run.metrics.truncate_rows` appends those the metrics file lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpcrl.run.checkpoint_manifest import step_of, checkpoint_root

__all__ = ["METRICS", "ROWS", "saved_rows", "tail_rows"]

ROWS = "rows.jsonl"
METRICS = "metrics.jsonl"
_TAIL = 1 << 16  # the rows of one step are a few hundred bytes each


def _key_of(line: str, key: str) -> float | None:
    try:
        row: Any = json.loads(line)
    except ValueError:
        return None
    value = row.get(key) if isinstance(row, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def tail_rows(metrics: Path, key: str = "env_steps") -> str:
    """The complete last lines of ``metrics`` that share the last line's ``key`` ("" when none)."""
    try:
        with open(metrics, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    lines = text.split("\n")
    lines = lines[1:-1] if size > _TAIL else lines[:-1]  # a cut first line; what follows the last newline
    keys = [_key_of(line, key) for line in lines]
    if not keys or keys[-1] is None:
        return ""
    first = len(keys)
    while first > 0 and keys[first - 1] == keys[-1]:
        first -= 1
    return "".join(line + "\n" for line in lines[first:])


def saved_rows(run_dir: Path, upto: float, key: str = "env_steps") -> list[str]:
    """The rows (raw lines) carried by the newest checkpoint of ``run_dir`` whose rows are at ``key`` <= ``upto``."""
    root = checkpoint_root(run_dir)
    try:
        dirs = sorted((p for p in root.iterdir() if step_of(p) >= 0), key=step_of, reverse=True)
    except FileNotFoundError:
        return []
    for path in dirs:
        try:
            lines = [line for line in (path / ROWS).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError):
            continue
        keys = [_key_of(line, key) for line in lines]
        if lines and all(k is not None and k <= upto for k in keys):
            return lines
    return []
