"""The spawned side of :func:`hpcrl.comm.spawn`: one rank's process, from start-up to its result file."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing import reduction
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from hpcrl.core.process_state import pid_alive

from .heartbeat import PeerLost
from .spawn_errors import is_config_error, is_data_error

_HOLD_S = 5.0  # a stop signal held for the rank function's own handler is delivered by default after this
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # what the ranks' StopRequest handles


def _die_with_parent(parent_pid: int, launcher_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), then make sure the parent
    did not die before we asked (we would have been re-parented, and nobody would ever kill us). The
    parent is the forkserver, which exits with the launcher, or the launcher itself."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid != launcher_pid:
        _release_forkserver()
    if os.getppid() != parent_pid or not pid_alive(launcher_pid, ""):
        os._exit(1)


def _release_forkserver() -> None:
    """The forkserver exits when the pipe from its launcher reaches EOF, but CPython hands the launcher's
    end of it to every child too: while a rank held it, a SIGKILLed launcher left the server, and so the
    ranks, running. Closed here, the launcher's death ends the server and the death signal ends the ranks."""
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        forkserver._forkserver._forkserver_alive_fd = None
        os.close(fd)


class InheritedFd:
    """One of the launcher's descriptors (its stdout, its stderr) as it is when a rank starts, given
    to that rank: a forkserver's children would otherwise write wherever the launcher's streams
    pointed when the server started (under pytest, a capture file of some earlier test)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _detach, (reduction.DupFd(self.fd),)  # valid only while a process is being started


def _detach(dup: Any) -> int:
    return dup.detach()


def _adopt_launcher(env: dict[str, str], streams: Sequence[int | None], mask: Sequence[int] | None) -> None:
    """What a spawned rank would have had from its launcher at start: its environment (the server's
    is the launcher's of long ago), its stdout / stderr, and its signal mask (set last: the stop signals
    stay blocked until the handlers that hold them are in place)."""
    os.environ.clear()
    os.environ.update(env)
    for target, fd in enumerate(streams, start=1):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)
    if "numpy" in sys.modules:  # a fork shares the server's global numpy RNG; a spawned rank drew its own
        sys.modules["numpy"].random.seed()
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def default_threads(env: dict[str, str]) -> int:
    """torch's intra-op thread count for a process started with ``env``: ``OMP_NUM_THREADS`` when set,
    else the CPUs this process may run on. Set explicitly in a rank: its torch was loaded by the server."""
    try:
        return max(1, int(env.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0))


class _Hold:
    """Stop signals that arrive before the rank function installed its own handler (imports, start-up):
    held, then re-sent to this process as soon as the handler is another one (polled from a thread,
    started only when something is held). A function that never installs one gets a held signal with
    the default action ``_HOLD_S`` after it arrived."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = tuple(signals)
        self.pending: dict[int, float] = {}  # signal -> when it arrived
        self.expired: set[int] = set()
        self.done, self.wake = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        self.handler = self._handle  # one bound-method object: getsignal() returns this very object
        for sig in self.signals:
            signal.signal(sig, self.handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum in self.expired:  # held too long: the default action after all
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.pending.setdefault(signum, time.monotonic())
        self.wake.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self._deliver, name="hpcrl-spawn-hold", daemon=True)
            self.thread.start()

    def _deliver(self) -> None:
        while not self.done.is_set():
            if not self.pending:
                self.wake.wait()
                self.wake.clear()
                continue
            for sig, since in list(self.pending.items()):
                if signal.getsignal(sig) is not self.handler:
                    del self.pending[sig]
                    os.kill(os.getpid(), sig)
                elif time.monotonic() - since > _HOLD_S:
                    del self.pending[sig]
                    self.expired.add(sig)
                    os.kill(os.getpid(), sig)
            self.done.wait(0.01)

    def close(self) -> None:
        self.done.set()
        self.wake.set()


def _quiet(signals: Sequence[int]) -> None:
    """The function is done: stop signals no longer mean anything here. SIG_IGN, because the
    interpreter resets Python-level handlers to SIG_DFL while it exits, and a signal then would
    kill a rank that finished its work."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


_SCRATCH: list[str] = []  # [scratch dir, rank] inside a spawned rank: where record_peer_lost writes


def scratch_dir() -> str | None:
    """Inside a spawned rank, its parent's scratch dir (where it leaves records for the parent); else None."""
    return _SCRATCH[0] if _SCRATCH else None


def record_log(path: Path, offset: int) -> None:
    """This rank's native stderr now goes to ``path`` from byte ``offset`` on (what an earlier job appended
    stays before it): the parent quotes its last line when this rank dies without a record."""
    if not _SCRATCH:
        return
    tmp, rank = _SCRATCH
    try:
        write_atomic(Path(tmp, f"log-{rank}"), json.dumps({"path": str(path), "offset": offset}).encode())
    except OSError:  # the parent then reports this rank's exit alone
        pass


def record_peer_lost(message: str, peer: int | None) -> None:
    """This rank's heartbeat watch is about to end it (``os._exit``, past any ``except``): leave the
    parent the record run_child would have, naming ``peer`` (None: the store) as the one to blame."""
    if not _SCRATCH:
        return
    tmp, rank = _SCRATCH
    record = {"time": time.time(), "type": "hpcrl.comm.heartbeat.PeerLost", "config": False, "data": False,
              "message": message, "last": f"PeerLost: {message}", "traceback": "", "lost": peer}
    try:
        write_atomic(Path(tmp, f"error-{rank}"), json.dumps(record).encode())
    except OSError:  # the parent then reports this rank's exit code; the rank's own line said who froze
        pass


def run_child(fn: Callable[..., Any], args: Sequence[Any], env: dict[str, str], num_threads: int | None, tmp: str,
              parents: tuple[int, int], hold: Sequence[int], ignore_sigint: bool, mask: Sequence[int] | None,
              streams: Sequence[int | None]) -> None:
    _die_with_parent(*parents)
    rank = env["RANK"]
    _SCRATCH[:] = [tmp, rank]
    held = _Hold(hold)
    if ignore_sigint:  # the parent turns Ctrl-C into SIGTERM for us; the terminal's own SIGINT is noise
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _adopt_launcher(env, streams, mask)
    torch.set_num_threads(num_threads if num_threads is not None else default_threads(env))
    try:
        result = fn(*args)
    except Exception as err:
        _quiet(STOP_SIGNALS)
        # A file, not a queue: a queue's feeder thread can deadlock a child that exits right after.
        lines = traceback.format_exception_only(type(err), err)
        record = {"time": time.time(), "type": f"{type(err).__module__}.{type(err).__qualname__}",
                  "config": is_config_error(err), "data": is_data_error(err), "message": str(err),
                  "last": (lines[-1] if lines else repr(err)).strip(), "traceback": traceback.format_exc()}
        if isinstance(err, PeerLost) and err.peer is not None:  # the launcher blames (and stops) that peer
            record["lost"] = int(err.peer)
        write_atomic(Path(tmp, f"error-{rank}"), json.dumps(record).encode())
        raise SystemExit(1) from None
    finally:
        held.close()
    _quiet(STOP_SIGNALS)
    write_atomic(Path(tmp, f"result-{rank}"), pickle.dumps(result))
