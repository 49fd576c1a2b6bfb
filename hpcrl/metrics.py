"""Run-directory logging on global rank 0: metrics.jsonl, TensorBoard, and a one-line progress display.

One schema for every algorithm: each row has ``time``, ``env_steps``, ``updates`` and the algorithm's
fields; TensorBoard gets the same values under the same names.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_env_steps and self.path.exists():
            # Rows written after the checkpoint we resume from are replayed by this run: drop them.
            rows = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["env_steps"] <= resume_env_steps]
            self.path.write_text("".join(r + "\n" for r in rows))
        elif not resume_env_steps:
            self.path.write_text("")
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                print("hpcrl: tensorboard not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            else:
                self._writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_env_steps or None)

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
