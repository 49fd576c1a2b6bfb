"""Disk faults while a run writes (a full disk, an I/O error): one line naming the path and the free space.

Checkpoint and metrics writers go through :func:`owned_file`: a file this process opens itself,
private (:func:`hpcrl.core.rundir_files.file_mode`) from its creation, handed to h5py or ``torch.save`` as
a Python file object. Every byte then passes through our ``write``, so a failed write is an
``OSError`` recorded here and reported as a :class:`DiskFault` whatever HDF5 or torch's zip writer
make of it (HDF5 reports a failed write of its own file descriptor as a generic error and may fail
again while closing; torch's writer reports a position mismatch). A fault removes the partial file.

:class:`DiskFault` is a :class:`hpcrl.core.config_check.RunDirError`: one line, no traceback, at the entry points.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

from hpcrl.core.config_check import RunDirError
from hpcrl.core.rundir_files import file_mode

__all__ = ["DISK_ERRNOS", "DiskFault", "fault_line", "free_space", "human_bytes", "is_disk_error", "owned_file",
           "quiet_writer_threads", "warn_low_space"]

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class DiskFault(RunDirError):
    """A write failed on the disk (full, quota, I/O error); the message names the path and the free space."""


def is_disk_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_ERRNOS


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_space(path: str | os.PathLike) -> tuple[int, int]:
    """(bytes free to this user, bytes in all) on the filesystem holding ``path`` (or its nearest existing parent)."""
    here = Path(path)
    while not here.exists() and here != here.parent:
        here = here.parent
    st = os.statvfs(here)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def fault_line(path: str | os.PathLike, err: OSError) -> str:
    """``PATH: No space left on device (12.0 KiB free of 2.0 MiB on its filesystem)``."""
    try:
        free, total = free_space(path)
        room = f"{human_bytes(free)} free of {human_bytes(total)} on its filesystem"
    except OSError:
        room = "free space unknown"
    return f"{path}: {err.strerror or err} ({room})"


class _OwnedFile(io.FileIO):
    """A raw file that writes every byte it is given (a short write is retried, never returned) and
    keeps the first error, so the caller can report it after a library has turned it into its own."""

    error: OSError | None = None

    def _record(self, err: OSError) -> None:
        if self.error is None:
            self.error = err

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += super().write(view[done:]) or 0
        except OSError as err:
            self._record(err)
            raise
        return done

    def truncate(self, size: int | None = None) -> int:
        try:
            return super().truncate(size)
        except OSError as err:
            self._record(err)
            raise


@contextlib.contextmanager
def owned_file(path: str | os.PathLike) -> Iterator[io.FileIO]:
    """Yield a private (0600 / 0640 from creation) read-write file for ``path``'s temporary sibling;
    on success fsync it and rename it over ``path``. On any failure the temporary file is removed and
    ``path`` is untouched; a failure of the disk (:data:`DISK_ERRNOS`) is raised as :class:`DiskFault`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    mode = file_mode()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    f = _OwnedFile(fd, "r+", closefd=True)
    try:
        try:
            os.fchmod(fd, mode)  # a leftover of the same name keeps its mode through O_TRUNC
            yield f
            os.fsync(fd)  # delayed allocation: a full disk may only show here
        except OSError as err:
            f._record(err)
            raise
        finally:
            with contextlib.suppress(OSError):
                f.close()
        os.replace(tmp, path)
    except BaseException:
        line = fault_line(path, f.error) if f.error is not None and is_disk_error(f.error) else None
        tmp.unlink(missing_ok=True)  # after measuring: the free space the write met, not what it leaves
        if line is not None:
            raise DiskFault(line) from None
        raise


_warned: set[str] = set()


def warn_low_space(where: str | os.PathLike, need: int, what: str) -> bool:
    """Print one warning line (once per process and ``where``) when the filesystem of ``where`` has less
    than ``need`` bytes free; True when it did."""
    key = str(where)
    try:
        free, _ = free_space(where)
    except OSError:
        return False
    if free >= need or key in _warned:
        return False
    _warned.add(key)
    print(f"hpcrl: warning: {where}: {human_bytes(free)} free, less than {what} needs ({human_bytes(need)}); "
          "free some space or it will fail", file=sys.stderr, flush=True)
    return True


_quiet_modules: set[str] = set()


def quiet_writer_threads(module: str) -> None:
    """A thread of a class from ``module`` (a library's background writer, e.g. TensorBoard's event writer)
    that dies of a disk error dies without printing a traceback: the library raises that error again in
    the thread that writes next, where it becomes one :class:`DiskFault` line. Other threads' deaths, and
    other errors, are reported as before (the previous ``threading.excepthook``)."""
    if not _quiet_modules:
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            where = type(args.thread).__module__ if args.thread is not None else ""
            quiet = args.exc_value is not None and is_disk_error(args.exc_value)
            if not (quiet and any(where == m or where.startswith(m + ".") for m in _quiet_modules)):
                previous(args)

        threading.excepthook = hook
    _quiet_modules.add(module)
