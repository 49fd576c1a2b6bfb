"""Files and directories a run writes: private modes, atomic replacement.

Run directories this code creates are ``0700``, checkpoint directories ``0700`` and the files
written through :func:`write_text` / :func:`atomic_path` (checkpoints, manifest, config.json,
metrics.jsonl, the lock) ``0600``. On a cluster where a group shares run directories set
``HPCRL_SHARED_RUN_DIR=1``: ``0750`` / ``0640`` (group may read, never write). An existing run
directory keeps its mode (this code never loosens or tightens a directory it did not create).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

__all__ = ["SHARED_ENV", "atomic_path", "dir_mode", "file_mode", "make_dir", "narrowed_umask", "shared",
           "write_text"]

SHARED_ENV = "HPCRL_SHARED_RUN_DIR"


def shared() -> bool:
    return os.environ.get(SHARED_ENV, "").strip().lower() not in ("", "0", "false", "no")


def dir_mode() -> int:
    return 0o750 if shared() else 0o700


def file_mode() -> int:
    return 0o640 if shared() else 0o600


def make_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p`` whose last component, when this call creates it, gets :func:`dir_mode` exactly
    (umask notwithstanding). Parents get the default mode; an existing directory is left as it is."""
    path = Path(path)
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=dir_mode())
    except FileExistsError:
        if not path.is_dir():
            raise
        return path
    os.chmod(path, dir_mode())
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary sibling path; on success give it ``mode`` (default
    :func:`file_mode`: 0600, or 0640 with ``HPCRL_SHARED_RUN_DIR=1``), fsync it and
    rename it over ``path``.

    A crash or exception before the rename leaves any previous file at ``path`` untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    mode = file_mode() if mode is None else mode
    try:
        # created private, so no byte is ever readable under the umask's mode; writers reopen it in place
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode & 0o600)
        try:
            os.fchmod(fd, mode & 0o600)  # a leftover of the same name keeps its mode through O_TRUNC
        finally:
            os.close(fd)
        yield tmp
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (temp file, fsync, rename), mode :func:`file_mode`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def narrowed_umask(mode: int) -> Iterator[None]:
    """Files created meanwhile get at most ``mode`` from their creation on (directories at most ``mode`` plus
    the search bits its read bits imply: 0600 -> 0700, 0640 -> 0750; the umask narrowed, never widened),
    for writers that open files by path themselves (TensorBoard's, torch.distributed.checkpoint's, an export's
    ``save_pretrained``): no chmod after, so no instant at the umask's wider mode. The umask is the process's."""
    old = os.umask(0o777)
    os.umask(old | (0o777 & ~(mode | (mode & 0o444) >> 2)))
    try:
        yield
    finally:
        os.umask(old)
