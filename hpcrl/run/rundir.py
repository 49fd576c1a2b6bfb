"""A run directory belongs to one run: a lock held for the life of the run.

**Lock.** Global rank 0 holds ``run_dir/.lock`` from start-up to the end of the run
(:func:`claim`, collective: the other ranks learn the outcome through the rendezvous store, so a
refused start exits 2 on every rank at once instead of hanging). The file is created with
``O_EXCL`` (present = taken; a clean exit removes it) and holds an exclusive ``flock`` plus a record
of the holder: host, pid, start time, Slurm job, a heartbeat counter rewritten every
:data:`HEARTBEAT_S` seconds. A second start refuses with "run dir X is in use by pid P on host H
since T; use another --run-dir or stop that run". A lock left by a dead run is stale and taken over
(with a note on stderr); a holder on this host that is dead or being killed while its flock is still
held (teardown of a SIGKILLed torch process takes seconds) is waited for, up to :data:`DYING_WAIT_S`:

- ``flock`` free and the holder ran on this host: it is dead (a flock dies with its process);
- ``flock`` free, holder on another host: the flock may be node-local (Lustre ``localflock``), so
  the heartbeat decides: unchanged for :data:`STALE_S` seconds = dead;
- no ``flock`` on this filesystem (some NFS/Lustre mounts): same host = is the pid (with its start
  time) still alive; other host = the heartbeat, as above. Taking over a stale lock without flock
  is best effort (two starts racing for the same dead lock within a fraction of a second could both
  win); if in doubt delete the ``.lock`` file named in the message.

The run dir's other jobs live beside this module and are re-exported here: modes and atomic writes
(:mod:`hpcrl.core.rundir_files`), the run's identity (:mod:`hpcrl.run.rundir_identity`), how the run ended
(:mod:`hpcrl.run.rundir_outcome`).

Errors are :class:`RunDirError` (a ``ValueError``): the entry points map them to exit 2 (bad
configuration) with the one-line message.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpcrl.core.config_check import RunDirError
from hpcrl.core.conventions import LAUNCHED_PID_ENV
from hpcrl.core.process_state import being_killed, pid_alive, proc_start
from hpcrl.core.rundir_files import SHARED_ENV, atomic_path, dir_mode, file_mode, make_dir, shared, write_text
from hpcrl.run.rundir_identity import identity_difference, identity_hash, normalize_identity
from hpcrl.run import rundir_outcome
from hpcrl.run.rundir_outcome import OUTCOME, clear_outcome, finished_by_this_job, record_outcome

__all__ = ["HEARTBEAT_S", "LOCK_NAME", "OUTCOME", "SHARED_ENV", "STALE_S", "RunDirError", "RunDirLock", "acquire",
           "atomic_path", "claim", "clear_outcome", "dir_mode", "file_mode", "finished_by_this_job",
           "identity_difference", "identity_hash", "make_dir", "normalize_identity", "probe", "record_outcome",
           "shared", "write_text"]

LOCK_NAME = ".lock"
HEARTBEAT_S = 5.0  # the holder rewrites its record this often
STALE_S = 30.0  # a record from another host whose heartbeat did not move for this long is stale (generous:
# a holder busy in a long C call that keeps the GIL, e.g. writing a big HDF5 shard, beats late)
DYING_WAIT_S = 20.0  # how long a start waits for the flock of a killed holder that is still tearing down
_STORE_KEY = "rundir/claim"
_RECORD_BYTES = 4096  # the record is rewritten in place at this fixed size: one page, no torn reads locally


def _holder_dying(record: dict[str, Any] | None) -> bool:
    """The record's holder ran on this host and is dead or being killed, yet its flock is still held: a
    killed process drops its files only once its teardown ends (a big torch process takes a while)."""
    if not record or record.get("host") != socket.gethostname():
        return False
    pid = _int(record.get("pid"))
    return pid > 0 and (not pid_alive(pid, str(record.get("pid_start", ""))) or being_killed(pid))


def _flock_after_dying_holder(fd: int, record: dict[str, Any] | None) -> bool | None:
    """Wait up to :data:`DYING_WAIT_S` for the flock of a dying holder (:func:`_holder_dying`)."""
    deadline = time.monotonic() + DYING_WAIT_S
    locked = _try_flock(fd)
    while locked is False and _holder_dying(record) and time.monotonic() < deadline:
        time.sleep(0.05)
        locked = _try_flock(fd)
    return locked


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError):
        return "an unknown time"


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "another process (it has not written its record yet)"
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    pid, launched = record.get("pid", "?"), record.get("launched_pid")
    who = f"pid {launched} (its rank 0 is pid {pid})" if launched and launched != pid else f"pid {pid}"
    return f"{who} on host {record.get('host', '?')} since {_when(record.get('started'))}{job}"


def _read_record_fd(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data.decode())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _settled_record(fd: int) -> dict[str, Any] | None:
    """The record, read again for up to a second while it is empty or unreadable (being written)."""
    for _ in range(10):
        if (record := _read_record_fd(fd)) is not None:
            return record
        time.sleep(0.1)
    return None


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _read_record(path: Path) -> dict[str, Any] | None:
    """A fresh open each time: on NFS close-to-open consistency then shows the holder's latest write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_record_fd(fd)
    finally:
        os.close(fd)


def _try_flock(fd: int) -> bool | None:
    """True: we hold it; False: another process does; None: this filesystem does not do flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS, errno.EBADF):
            return None
        raise


def _heartbeat_moves(path: Path, record: dict[str, Any] | None) -> bool:
    """Watch the record for up to STALE_S seconds: True as soon as it changes (its holder is alive)."""
    deadline = time.monotonic() + STALE_S
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(STALE_S / 10, 0.01)))
        now = _read_record(path)
        if now != record:
            return True
    return False


class RunDirLock:
    """The run-dir lock of this process (``held`` False on ranks other than 0: nothing to release)."""

    def __init__(self, path: Path | None, fd: int | None = None, flock: bool = False,
                 record: dict[str, Any] | None = None, made_dirs: tuple[Path, ...] = ()) -> None:
        self.path, self._fd, self.flock, self.record = path, fd, flock, record
        self.made_dirs = made_dirs  # directories acquire() made, deepest first: removed on release if still empty
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="rundir-heartbeat", daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _write(self) -> None:
        assert self._fd is not None and self.record is not None
        os.pwrite(self._fd, _encode(self.record), 0)
        os.fsync(self._fd)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                assert self.record is not None
                self.record["beat"] = self.record.get("beat", 0) + 1
                self._write()
            except (OSError, AssertionError):  # released meanwhile, or the filesystem hiccuped: next beat
                pass

    def release(self) -> None:
        """Remove the lock file (first, so a waiter that opened it sees it gone) and drop the flock."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        fd, self._fd = self._fd, None
        try:
            if self.path is not None and _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)
        _remove_empty(self.made_dirs)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _remove_empty(dirs: tuple[Path, ...]) -> None:
    """A start that failed before writing anything leaves no empty run dir behind."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # not empty (the run wrote something), or gone: keep it / nothing to do
            return


def _missing_dirs(path: Path) -> tuple[Path, ...]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing = []
    for at in (path, *path.parents):
        if at.exists():
            break
        missing.append(at)
    return tuple(missing)


def probe(run_dir: str | os.PathLike) -> None:
    """:class:`RunDirError` at once when a live process on this host holds ``run_dir``'s lock: what an
    entry point can tell before it spawns anything. Locks held elsewhere (a heartbeat to watch) are
    left to :func:`claim`."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        locked = _try_flock(fd)
        record = _settled_record(fd) if locked is not True else _read_record_fd(fd)
        if locked is False and _holder_dying(record):
            return  # its holder is being killed: claim() waits for the flock
    finally:
        os.close(fd)  # drops the flock if we took it
    if record and record.get("host") == socket.gethostname() and _int(record.get("pid")) == os.getpid():
        return  # this process holds it (flock would refuse our second open of the same file)
    if locked is False or (locked is None and record and record.get("host") == socket.gethostname()
                           and pid_alive(_int(record.get("pid")), str(record.get("pid_start", "")))):
        raise _in_use(Path(run_dir), record)


def _encode(record: dict[str, Any]) -> bytes:
    data = json.dumps(record)
    if len(data) >= _RECORD_BYTES:
        data = json.dumps({**record, "argv": record.get("argv", [])[:1]})[: _RECORD_BYTES - 1]
    return (data.ljust(_RECORD_BYTES - 1) + "\n").encode()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _my_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
            "launched_pid": _int(os.environ.get(LAUNCHED_PID_ENV, os.getpid())), "started": time.time(),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "argv": sys.argv, "beat": 0}


def _in_use(run_dir: Path, record: dict[str, Any] | None, extra: str = "") -> RunDirError:
    return RunDirError(f"run dir {run_dir} is in use by {_describe(record)}{extra}; use another --run-dir or "
                       "stop that run")


def acquire(run_dir: str | os.PathLike) -> RunDirLock:
    """Create ``run_dir`` if needed and take its lock; :class:`RunDirError` when a live run holds it."""
    run_dir = Path(run_dir)
    made_dirs = _missing_dirs(run_dir)
    try:
        make_dir(run_dir)
    except OSError as err:
        raise RunDirError(f"cannot create run dir {run_dir}: {err.strerror or err}") from None
    try:
        return _acquire(run_dir, made_dirs)
    except BaseException:
        _remove_empty(made_dirs)
        raise


def _acquire(run_dir: Path, made_dirs: tuple[Path, ...]) -> RunDirLock:
    path = run_dir / LOCK_NAME
    me = socket.gethostname()
    for _ in range(20):  # retried only when the file vanished or was replaced between our steps
        created = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, file_mode())
        except FileExistsError:
            created = False
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        except OSError as err:
            raise RunDirError(f"cannot create the lock file {path}: {err.strerror or err}") from None
        try:
            locked = _try_flock(fd)
            if locked is False:
                locked = _flock_after_dying_holder(fd, _settled_record(fd))
            if locked is False:
                raise _in_use(run_dir, _settled_record(fd))
            if not _same_file(fd, path):  # released (unlinked) while we opened it: start over
                os.close(fd)
                continue
            previous = None if created else _settled_record(fd)
            if not created:
                if previous and previous.get("host") != me:
                    # flock may be node-local here (or missing): only a stopped heartbeat proves it dead
                    if _heartbeat_moves(path, previous):
                        raise _in_use(run_dir, _read_record(path), " (its heartbeat is live)")
                elif previous and locked is None and pid_alive(_int(previous.get("pid")),
                                                                str(previous.get("pid_start", ""))):
                    raise _in_use(run_dir, previous)
                elif not previous and locked is None:
                    raise RunDirError(f"run dir {run_dir} is locked by {path}, whose record is unreadable, and "
                                      "this filesystem has no flock to tell whether its holder lives; if no run "
                                      f"uses {run_dir}, delete {path}")
            record = _my_record()
            lock = RunDirLock(path, fd, locked is True, record, made_dirs)
            try:
                lock._write()
            except OSError as err:
                raise RunDirError(f"cannot write the lock file {path}: {err.strerror or err}") from None
            if locked is None and not created:
                time.sleep(0.5)  # no flock: a racing taker of the same stale lock may have overwritten us
                now = _read_record(path) or {}
                if (now.get("host"), now.get("pid")) != (record["host"], record["pid"]):
                    raise _in_use(run_dir, now)
            if previous:
                print(f"hpcrl: run dir {run_dir}: took over the stale lock of {_describe(previous)} "
                      "(that run is gone)", file=sys.stderr, flush=True)
            lock._start_heartbeat()
            return lock
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise RunDirError(f"could not take the lock {path}: it keeps being replaced; is another run starting there?")


def claim(run_dir: str | os.PathLike, ctx: Any = None) -> RunDirLock:
    """Collective (every rank of ``ctx``'s world calls it before anything touches ``run_dir``): global
    rank 0 takes the lock and publishes the outcome on the rendezvous store; every rank raises the
    same :class:`RunDirError` when it is refused. Returns the lock (``held`` only on rank 0)."""
    if ctx is None or not getattr(ctx, "is_distributed", False) or ctx.store is None:
        return acquire(run_dir)
    from hpcrl.comm import barrier

    store = ctx.store
    if ctx.rank == 0:
        try:
            lock = acquire(run_dir)
        except Exception as err:
            message = str(err) if isinstance(err, RunDirError) else f"run dir {run_dir}: {type(err).__name__}: {err}"
            store.set(_STORE_KEY, "error\n" + message)
            try:  # rank 0 may host the store: leave only once every rank has read it
                barrier(ctx, "rundir-claim")
            except Exception:  # noqa: BLE001  (a peer gone meanwhile: our message is still the one to give)
                pass
            raise RunDirError(message) from None
        store.set(_STORE_KEY, "ok")
    else:
        store.wait([_STORE_KEY], ctx.timeout)
        status, _, message = store.get(_STORE_KEY).decode().partition("\n")
        lock = RunDirLock(None)
        barrier(ctx, "rundir-claim")
        if status != "ok":
            raise RunDirError(message)
        return lock
    barrier(ctx, "rundir-claim")
    return lock


if __name__ == "__main__":
    sys.exit(rundir_outcome.main(sys.argv[1:]))
