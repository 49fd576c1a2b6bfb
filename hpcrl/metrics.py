"""Run-directory logging on global rank 0: metrics.jsonl, TensorBoard, and a one-line progress display.

One schema for every algorithm: each row has ``time``, ``env_steps``, ``updates`` and the algorithm's
fields; TensorBoard gets the same values under the same names. On a resume the rows after the
checkpoint are dropped atomically (:func:`truncate_rows`; a torn last line is repaired, not fatal).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpcrl.rundir import file_mode, make_dir, write_text


def truncate_rows(path: Path, resume_env_steps: int, key: str = "env_steps") -> int:
    """Keep the rows of ``path`` up to the checkpoint a run resumes from (``row[key] <= resume_env_steps``);
    the rows after it are replayed by the resumed run. The file is replaced atomically (a crash here
    leaves the old one). A torn last line (the previous run was killed mid-write) or any other line
    that is not a JSON object is dropped with a note on stderr, never fatal. Returns the rows kept."""
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    kept: list[str] = []
    bad: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            value = row[key] if isinstance(row, dict) else None
            if not isinstance(value, (int, float)):
                raise ValueError(f"no numeric {key!r}")
        except ValueError:
            bad.append(number)
            continue
        if value <= resume_env_steps:
            kept.append(line)
    if bad:
        torn = bad == [len(lines)]
        what = "a torn last line" if torn else f"{len(bad)} unreadable line(s) (line {', '.join(map(str, bad[:5]))})"
        print(f"hpcrl: {path}: dropped {what}" + (" (the previous run was killed while writing it)" if torn else ""),
              file=sys.stderr, flush=True)
    write_text(path, "".join(r + "\n" for r in kept))
    return len(kept)


class RunLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, total_env_steps: int, resume_env_steps: int = 0,
                 tensorboard: bool = True, progress_every_s: float = 10.0, progress_key: str = "env_steps") -> None:
        self.enabled = enabled
        self.total = total_env_steps
        self._progress_key = progress_key  # the row field that runs from 0 to `total`
        self.start = time.time()
        self._last_print = 0.0
        self._tty = sys.stderr.isatty()
        self._progress_every_s = progress_every_s
        self._writer = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        make_dir(self.path.parent)
        if resume_env_steps and self.path.exists():
            truncate_rows(self.path, resume_env_steps)
        elif not resume_env_steps:
            write_text(self.path, "")
        self._file = open(self.path, "a", buffering=1, opener=lambda p, flags: os.open(p, flags, file_mode()))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                print("hpcrl: tensorboard not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            else:
                # purge_step: TensorBoard hides the events of this step on from earlier writers of the
                # directory (the replayed steps after a resume; everything of the previous run on a fresh start)
                self._writer = SummaryWriter(str(make_dir(Path(run_dir) / "tb")), purge_step=resume_env_steps)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"time": round(time.time() - self.start, 3), **row}
        self._file.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for key, value in row.items():
                if key not in ("time", "env_steps") and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, row["env_steps"])
        self._progress(row)

    def _progress(self, row: dict[str, Any]) -> None:
        now = time.time()
        done = row[self._progress_key] >= self.total
        if not self._tty and not done and now - self._last_print < self._progress_every_s:
            return
        self._last_print = now
        pct = 100.0 * row[self._progress_key] / max(self.total, 1)
        fields = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in row.items() if k not in ("time",))
        line = f"[{pct:5.1f}%] {fields}"
        if self._tty:
            print("\r" + line[:200].ljust(200), end="\n" if done else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._writer is not None:
            self._writer.close()
