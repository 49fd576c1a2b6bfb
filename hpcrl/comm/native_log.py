"""A rank's native stderr in its log file, Python's on the terminal.

torch's C++ side writes straight to file descriptor 2: c10d warnings with twenty C++ frames each when
a store connection breaks, gloo and NCCL logs. Pointed at ``RUN_DIR/logs/rank<N>.log``, they are kept
for a bug report while the terminal shows the one-line reason a distributed failure ends with; Python's
``sys.stderr`` (errors, warnings, progress) moves to a copy of the original descriptor. A rank of
:func:`hpcrl.comm.spawn` that dies without a Python error (a C++ abort, a signal) has the last line its
native side wrote there quoted in the parent's failure line.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import TextIO

from hpcrl.core.rundir_files import file_mode, make_dir

from .spawn_child import record_log

__all__ = ["divert_native_stderr", "restore_native_stderr", "terminal_fd"]

_saved: list[tuple[int, TextIO]] = []  # (a copy of the original fd 2, the original sys.stderr)


def divert_native_stderr(log_dir: str | os.PathLike, rank: int) -> Path:
    """Point fd 2 at ``log_dir/rank<rank>.log`` (appended, the run dir's file mode) and ``sys.stderr`` at
    the terminal; returns the log's path. A second call while diverted changes nothing."""
    path = make_dir(log_dir) / f"rank{rank}.log"
    if _saved:
        return path
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, file_mode())
    record_log(path, os.fstat(fd).st_size)  # under hpcrl.comm.spawn: a death without a record quotes it
    terminal = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    _saved.append((terminal, sys.stderr))
    # line buffered, as Python's own stderr: each line is on the terminal as soon as it is written
    sys.stderr = open(os.dup(terminal), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",
                      errors="backslashreplace")
    if faulthandler.is_enabled():  # a fatal signal's Python traceback stays where the user looks
        faulthandler.enable(sys.stderr)
    return path


def restore_native_stderr() -> None:
    """Undo :func:`divert_native_stderr`: fd 2 and ``sys.stderr`` back as they were."""
    if not _saved:
        return
    terminal, original = _saved.pop()
    sys.stderr.flush()
    diverted, sys.stderr = sys.stderr, original
    os.dup2(terminal, 2)
    os.close(terminal)
    if faulthandler.is_enabled():
        faulthandler.enable(sys.stderr)
    diverted.close()


def terminal_fd() -> int:
    """Where a line for the user goes: the terminal, diverted or not."""
    return _saved[0][0] if _saved else 2
