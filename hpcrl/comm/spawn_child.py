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
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .spawn_errors import is_config_error, is_data_error

_HOLD_S = 5.0  # a stop signal held for the rank function's own handler is delivered by default after this
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # what the ranks' StopRequest handles


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), then make sure the parent
    did not die before we asked (we would have been re-parented, and nobody would ever kill us)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


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
           parent_pid: int, hold: Sequence[int], ignore_sigint: bool, unblock: Sequence[int]) -> None:
    _die_with_parent(parent_pid)
    os.environ.update(env)
    rank = env["RANK"]
    _SCRATCH[:] = [tmp, rank]
    held = _Hold(hold)
    if ignore_sigint:  # the parent turns Ctrl-C into SIGTERM for us; the terminal's own SIGINT is noise
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if unblock:  # the parent blocked them while starting us, so none could kill us during the imports
        signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        result = fn(*args)
    except Exception as err:
        _quiet(STOP_SIGNALS)
        # A file, not a queue: a queue's feeder thread can deadlock a child that exits right after.
        lines = traceback.format_exception_only(type(err), err)
        record = {"time": time.time(), "type": f"{type(err).__module__}.{type(err).__qualname__}",
                  "config": is_config_error(err), "data": is_data_error(err), "message": str(err),
                  "last": (lines[-1] if lines else repr(err)).strip(), "traceback": traceback.format_exc()}
        write_atomic(Path(tmp, f"error-{rank}"), json.dumps(record).encode())
        raise SystemExit(1) from None
    finally:
        held.close()
    _quiet(STOP_SIGNALS)
    write_atomic(Path(tmp, f"result-{rank}"), pickle.dumps(result))
