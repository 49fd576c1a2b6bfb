"""Run-directory logging on global rank 0: metrics.jsonl, TensorBoard, and a one-line progress display.

One schema for every algorithm: each row has ``time``, ``env_steps``, ``updates`` and the algorithm's
fields; TensorBoard gets the same values under the same names. On a resume the rows after the
checkpoint are dropped atomically (:func:`truncate_rows`; a torn last line is repaired, not fatal, and
the rows of the checkpoint's step come back from the checkpoint: :mod:`hpcrl.run.checkpoint_rows`). A
write that fails on the disk is a :class:`~hpcrl.core.diskfault.DiskFault` (path, free space), not a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import secrets
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, TextIO

from hpcrl.run.checkpoint_rows import saved_rows
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import EXIT_DISK
from hpcrl.core.diskfault import DiskFault, fault_line, free_space, human_bytes, is_disk_error, quiet_writer_threads
from hpcrl.run.progress import LOG_WIDTH, early_stop_line, fit, progress_fields, recent_rate, summary_lines
from hpcrl.run.rundir import file_mode, make_dir, write_text
from hpcrl.core.rundir_files import narrowed_umask


RATE_ROWS = 8  # the ETA's rate is measured over this many latest rows
# W&B writes its offline files from its own process and reports a failed write only in its own log (the
# rows are dropped unseen): below this much free space on their disk, the run stops with a DiskFault instead
WANDB_MIN_FREE = 1 << 20


def truncate_rows(path: Path, resume_env_steps: int, key: str = "env_steps") -> int:
    """Keep the rows of ``path`` up to the checkpoint a run resumes from (``row[key] <= resume_env_steps``);
    the rows after it are replayed by the resumed run. The file is replaced atomically (a crash here
    leaves the old one). A torn last line (the previous run was killed mid-write) or any other line
    that is not a JSON object is dropped with a note on stderr, never fatal; the rows of the checkpoint's
    step that the file lacks (torn, or lost with the page cache) come back from the checkpoint
    (:func:`hpcrl.run.checkpoint_rows.saved_rows`). Returns the rows kept and restored."""
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
    back = _missing_rows(kept, saved_rows(path.parent, resume_env_steps, key), key)
    if back:
        print(f"hpcrl: {path}: restored {len(back)} row(s) of the checkpoint's step from the checkpoint",
              file=sys.stderr, flush=True)
    try:
        write_text(path, "".join(r + "\n" for r in kept + back))
    except OSError as err:
        raise DiskFault(fault_line(path, err)) from None
    return len(kept) + len(back)


def _missing_rows(kept: list[str], saved: list[str], key: str) -> list[str]:
    """The rows a checkpoint carries that the kept rows lack; only after the last kept row (a lost or torn
    write is always at the end), so a row at an earlier step is never moved."""
    last = json.loads(kept[-1])[key] if kept else -math.inf
    have = set(kept)
    return [line for line in saved if line not in have and json.loads(line)[key] >= last]


def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every non-finite float (NaN: a window in which no episode ended; inf) as None, so
    metrics.jsonl is strict JSON (``null``; every row keeps the same keys)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


class RunLogger:
    """Rank 0's sink of metrics rows: metrics.jsonl (strict JSON, NaN as ``null``), TensorBoard, optional
    Weights & Biases (same rows), and the progress display on stderr.

    Progress: on a terminal, one line per row that fits its width (whole fields dropped, never cut),
    overwritten in place, eval rows kept; elsewhere (files, Slurm logs) one full line per row at most
    every ``progress_every_s`` seconds (plus the last row and every eval row), no carriage returns.
    End a run with :meth:`finish` (the summary line) or :meth:`early_stop` (says why it stopped).
    """

    def __init__(self, run_dir: str | Path, enabled: bool, total_env_steps: int, resume_env_steps: int = 0,
                 tensorboard: bool = True, progress_every_s: float = 10.0, progress_key: str = "env_steps", *,
                 stream: TextIO | None = None, width: int | None = None, wandb_project: str | None = None,
                 wandb_mode: str = "online", wandb_config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.total = total_env_steps
        self._progress_key = progress_key  # the row field that runs from 0 to `total`
        self.start = time.time()
        self._last_print = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = width is not None or self._stream.isatty()
        self._width = width  # None on a terminal: its current width, read per line (it may be resized)
        self._open_line = False  # a tty line without its newline yet
        self._progress_every_s = progress_every_s
        self._last_return: float | None = None
        self._return_age = 0
        # (time, progress value) of this process's latest rows, for the ETA; a fresh run starts at (start, 0),
        # a resumed one at its first row (the earlier steps are not this process's speed)
        self._recent: deque[tuple[float, float]] = deque(maxlen=RATE_ROWS)
        if not resume_env_steps:
            self._recent.append((self.start, 0.0))
        self._writer = None
        self._wandb = None
        self._wandb_files = False
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        if not enabled:
            return
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
                tb = make_dir(Path(run_dir) / "tb")
                quiet_writer_threads("tensorboard")  # its writer thread's disk error comes back in _events
                with narrowed_umask(file_mode()):  # the writer creates its event file here, by path
                    self._writer = self._events(lambda: SummaryWriter(str(tb), purge_step=resume_env_steps))
        self._wandb_files = bool(wandb_project) and wandb_mode != "disabled"  # W&B writes files: watch their disk
        if self._wandb_files:
            check_wandb_room(wandb_dir(self.run_dir))
        if wandb_project:
            self._wandb = open_wandb(self.run_dir, wandb_project, wandb_mode, wandb_config or {},
                                     resume=bool(resume_env_steps))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = finite_row({"time": round(time.time() - self.start, 3), **row})
        try:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
        except OSError as err:
            raise DiskFault(fault_line(self.path, err)) from None
        numbers = {k: v for k, v in row.items()
                   if k not in ("time", "env_steps") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._writer is not None:
            writer = self._writer
            self._events(lambda: [writer.add_scalar(key, value, row["env_steps"]) for key, value in numbers.items()])
        if self._wandb is not None:
            self._wandb.log({**numbers, "env_steps": row["env_steps"]}, step=int(row["env_steps"]))
            try:
                if self._wandb_files:
                    check_wandb_room(wandb_dir(self.run_dir))
            except DiskFault:
                self._close_wandb(EXIT_DISK)
                raise
        self._progress(row)

    def _progress(self, row: dict[str, Any]) -> None:
        now = time.time()
        if isinstance(row.get("episode_return"), (int, float)):
            self._last_return, self._return_age = float(row["episode_return"]), 0
        elif self._last_return is not None and "eval_return" not in row:
            self._return_age += 1
        at = row.get(self._progress_key) or 0
        if "eval_return" not in row:  # eval rows repeat a training row's step: no progress
            self._recent.append((now, float(at)))
        done = at >= self.total
        keep = done or "eval_return" in row  # lines worth keeping on screen and in logs
        if not self._tty and not keep and now - self._last_print < self._progress_every_s:
            return
        self._last_print = now
        rate = recent_rate(list(self._recent))
        fields = progress_fields(row, key=self._progress_key, total=self.total, elapsed_s=now - self.start,
                                 rate=rate, last_return=self._last_return, return_age=self._return_age)
        if self._tty:
            line = fit(fields, self._columns())
            self._stream.write("\r\x1b[K" + line + ("\n" if keep else ""))
            self._open_line = not keep
        else:
            self._stream.write(fit(fields, LOG_WIDTH) + "\n")
        self._stream.flush()

    def _columns(self) -> int:
        return self._width if self._width is not None else max(20, shutil.get_terminal_size().columns - 1)

    def _say(self, line: str) -> None:
        if self._open_line:
            self._stream.write("\n")
            self._open_line = False
        self._stream.write(line + "\n")
        self._stream.flush()

    def finish(self, results: dict[str, Any] | None = None, paths: dict[str, Any] | None = None, *,
               stopped: str | None = None) -> None:
        """Print the summary (``done in 1m02s: eval_return=...`` then one line per place, ``checkpoint DIR``, ``metrics FILE``; with
        ``stopped="SIGTERM"``: ``stopped (SIGTERM) after ...; resume with --resume``); rank 0 only (a no-op
        elsewhere). W&B is closed first, so its own summary block comes before these lines, not after."""
        if not self.enabled:
            return
        self._close_wandb()
        paths = {**(paths or {}), "metrics": self.path}
        for line in summary_lines(time.time() - self.start, results or {}, paths, stopped=stopped):
            self._say("hpcrl: " + line)

    def early_stop(self, reason: str, at: Any) -> None:
        """Print that the run stopped before its budget and why, e.g. ``early_stop("episode_return_recent
        480.2 >= --target-return 475", at=row["updates"])``; call :meth:`finish` after it."""
        if not self.enabled:
            return
        self._say("hpcrl: " + early_stop_line(reason, key=self._progress_key, at=at, total=self.total,
                                               elapsed_s=time.time() - self.start))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._open_line:
            self._say("")
        self._file.close()
        try:
            if self._writer is not None:
                writer = self._writer
                self._events(writer.flush)  # raises what its writer thread met since the last row
                writer.close()
        finally:
            self._close_wandb()

    def _events(self, call: Callable[[], Any]) -> Any:
        """A TensorBoard call's result; a disk error its writer thread met (raised again here, by the next
        call) is a :class:`DiskFault`, and the writer, dead for good, is dropped."""
        try:
            return call()
        except OSError as err:
            if not is_disk_error(err):
                raise
            self._writer = None
            raise DiskFault(fault_line(self.run_dir / "tb", err)) from None

    def _close_wandb(self, exit_code: int | None = None) -> None:
        """Finish the W&B run; after a fault (``exit_code``) without its summary block or its own logging
        errors on the terminal: the fault's one line says what happened."""
        if self._wandb is None:
            return
        run, self._wandb = self._wandb, None
        if exit_code is None:
            run.finish()
            return
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            run.finish(exit_code=exit_code)


WANDB_MODES = ("online", "offline", "disabled")


def wandb_dir(run_dir: Path) -> Path:
    """Where W&B writes its files (``WANDB_DIR``, else the run dir)."""
    return Path(os.environ.get("WANDB_DIR") or str(run_dir))


def check_wandb_room(where: Path) -> None:
    """A :class:`DiskFault` when ``where``'s filesystem has under :data:`WANDB_MIN_FREE` free."""
    try:
        free, total = free_space(where)
    except OSError as err:
        if is_disk_error(err):
            raise DiskFault(fault_line(where, err)) from None
        return
    if free < WANDB_MIN_FREE:
        raise DiskFault(f"{where}: {os.strerror(errno.ENOSPC)} for W&B's files ({human_bytes(free)} free of "
                        f"{human_bytes(total)} on its filesystem; W&B needs {human_bytes(WANDB_MIN_FREE)} to "
                        "write without losing rows)")


def open_wandb(run_dir: Path, project: str, mode: str, config: dict[str, Any], resume: bool) -> Any:
    """A W&B run for this run dir (imported here: wandb is an optional extra). Its id is kept in
    ``RUN_DIR/wandb_id`` so a ``--resume`` continues the same W&B run instead of starting another."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"--wandb-project {project}: wandb is not installed; pip install 'hpcrl[wandb]' "
                          "(or pip install wandb), or drop --wandb-project") from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if resume and id_file.exists() else secrets.token_hex(4)
    write_text(id_file, run_id)
    return wandb.init(project=project, mode=mode, id=run_id, resume="allow", config=config,
                      dir=str(wandb_dir(run_dir)), name=run_dir.name)
