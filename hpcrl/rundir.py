"""A run directory belongs to one run: a lock for the life of the run, the run's identity, private modes.

**Lock.** Global rank 0 holds ``run_dir/.lock`` from start-up to the end of the run
(:func:`claim`, collective: the other ranks learn the outcome through the rendezvous store, so a
refused start exits 2 on every rank at once instead of hanging). The file is created with
``O_EXCL`` (present = taken; a clean exit removes it) and holds an exclusive ``flock`` plus a record
of the holder: host, pid, start time, Slurm job, a heartbeat counter rewritten every
:data:`HEARTBEAT_S` seconds. A second start refuses with "run dir X is in use by pid P on host H
since T; use another --run-dir or stop that run". A lock left by a dead run is stale and taken over
(with a note on stderr):

- ``flock`` free and the holder ran on this host: it is dead (a flock dies with its process);
- ``flock`` free, holder on another host: the flock may be node-local (Lustre ``localflock``), so
  the heartbeat decides: unchanged for :data:`STALE_S` seconds = dead;
- no ``flock`` on this filesystem (some NFS/Lustre mounts): same host = is the pid (with its start
  time) still alive; other host = the heartbeat, as above. Taking over a stale lock without flock
  is best effort (two starts racing for the same dead lock within a fraction of a second could both
  win); if in doubt delete the ``.lock`` file named in the message.

**Identity.** What must not change on resume (FastSAC: env, sizes, seed, world size, network shapes,
...): the caller passes a flat dict; checkpoints store it with :func:`identity_hash`, and
:func:`identity_difference` names the first field that differs, with both values.

**Modes.** Run directories this code creates are ``0700``, checkpoint directories ``0700`` and the
files written through :func:`write_text` / :func:`atomic_path` (checkpoints, manifest,
config.json, metrics.jsonl, the lock) ``0600``. On a cluster where a group shares run directories
set ``HPCRL_SHARED_RUN_DIR=1``: ``0750`` / ``0640`` (group may read, never write). An existing run
directory keeps its mode (this code never loosens or tightens a directory it did not create).

Errors are :class:`RunDirError` (a ``ValueError``): the entry points map them to exit 2 (bad
configuration) with the one-line message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

__all__ = ["HEARTBEAT_S", "LOCK_NAME", "STALE_S", "RunDirError", "RunDirLock", "acquire", "atomic_path", "claim", "dir_mode",
           "file_mode", "identity_difference", "identity_hash", "make_dir", "normalize_identity", "probe", "write_text"]

LOCK_NAME = ".lock"
LAUNCHED_PID_ENV = "HPCRL_LAUNCHED_PID"  # set by hpcrl.comm.spawn: the pid of the command that spawned the ranks
SHARED_ENV = "HPCRL_SHARED_RUN_DIR"
HEARTBEAT_S = 5.0  # the holder rewrites its record this often
STALE_S = 30.0  # a record from another host whose heartbeat did not move for this long is stale (generous:
# a holder busy in a long C call that keeps the GIL, e.g. writing a big HDF5 shard, beats late)
_STORE_KEY = "rundir/claim"
_RECORD_BYTES = 4096  # the record is rewritten in place at this fixed size: one page, no torn reads locally


class RunDirError(ValueError):
    """The run directory cannot be used as asked (in use, another run's checkpoint, nothing to resume,
    no usable checkpoint); the message says what to do. Entry points exit 2 on it."""


# -- modes ------------------------------------------------------------------------------------------
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
    try:
        yield tmp
        os.chmod(tmp, file_mode() if mode is None else mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (temp file, fsync, rename), mode :func:`file_mode`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


# -- identity ---------------------------------------------------------------------------------------
def normalize_identity(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity as JSON will give it back (tuples -> lists, keys -> str), so both sides compare alike."""
    return json.loads(json.dumps(dict(identity), default=str))


def identity_hash(identity: Mapping[str, Any]) -> str:
    canonical = json.dumps(normalize_identity(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


_ABSENT = object()


def identity_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """None when equal; else "FIELD is A in the checkpoint but B in this run" for the first field
    (in ``current``'s order) that differs, plus the names of the other differing fields."""
    saved, current = normalize_identity(saved), normalize_identity(current)
    keys = list(current) + [k for k in saved if k not in current]
    differ = [k for k in keys if saved.get(k, _ABSENT) != current.get(k, _ABSENT)]
    if not differ:
        return None

    def show(value: Any) -> str:
        return "absent" if value is _ABSENT else json.dumps(value)

    first = differ[0]
    text = (f"{first} is {show(saved.get(first, _ABSENT))} in the checkpoint but "
            f"{show(current.get(first, _ABSENT))} in this run")
    if len(differ) > 1:
        text += f" (also different: {', '.join(differ[1:])})"
    return text


# -- the lock ---------------------------------------------------------------------------------------
def proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the "(comm)" field


def pid_alive(pid: int, start: str) -> bool:
    """``pid`` runs and is the process that started at ``start`` (:func:`proc_start`; "" = unknown)."""
    if pid <= 0:  # never os.kill(0 or -1, ...): those address process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return not start or not (now := proc_start(pid)) or now == start  # a reused pid is another process


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


# -- outcome ----------------------------------------------------------------------------------------
# What the run's own process says about how it ended, for the batch scripts: srun reports the worst
# task's exit code, so a detached-PPO job whose expendable maker was SIGKILLed looks failed (137)
# although the trainers finished. Trainer 0 records "finished" as its last act; the script asks
# `python -m hpcrl.rundir finished RUN_DIR` before believing srun's code.
OUTCOME = "outcome.json"


def _job() -> dict[str, str | None]:
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID"), "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}


def clear_outcome(run_dir: str | os.PathLike) -> None:
    """At the start of a run (or of a resumed one): no outcome until this run says how it ended."""
    Path(run_dir, OUTCOME).unlink(missing_ok=True)


def record_outcome(run_dir: str | os.PathLike, status: str, **fields: Any) -> None:
    """Atomically write ``run_dir/outcome.json``: ``status`` (e.g. "finished"), this job's id and
    restart count, and ``fields`` (JSON-serialisable numbers of the final row)."""
    write_text(Path(run_dir, OUTCOME), json.dumps({"status": status, **_job(), "time": time.time(), **fields}))


def finished_by_this_job(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The outcome record when it says "finished" and was written by this Slurm job and restart (any
    job when not under Slurm), else None."""
    try:
        record = json.loads(Path(run_dir, OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "finished":
        return None
    job = _job()
    if job["slurm_job_id"] is not None and (record.get("slurm_job_id"), record.get("restart")) != (
            job["slurm_job_id"], job["restart"]):
        return None
    return record


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "finished":
        print("usage: python -m hpcrl.rundir finished RUN_DIR  (exit 0 iff this job's run finished)", file=sys.stderr)
        return 2
    record = finished_by_this_job(argv[1])
    if record is None:
        return 1
    print(", ".join(f"{k}={v}" for k, v in record.items() if k not in ("status", "time", "slurm_job_id", "restart")))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
