"""How :func:`hpcrl.comm.spawn`'s parent forwards stop signals to its live ranks: SIGTERM and SIGUSR2 as
they are, SIGINT (Ctrl-C) as SIGTERM, a second SIGINT as SIGKILL and :class:`KeyboardInterrupt`."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Sequence

from .spawn_exits import signal_name

__all__ = ["Forwarder"]


class Forwarder:
    """The parent's handlers for the forwarded signals (installed only from the main thread)."""

    def __init__(self, signals: Sequence[int], procs: list, live: set[int]) -> None:
        self.signals = tuple(dict.fromkeys(int(s) for s in signals))
        self.procs, self.live = procs, live
        self.previous: dict[int, Any] = {}
        self.requested: str = ""  # the first forwarded signal's name
        self.interrupts = 0
        self.killed = False
        self.marker: Path | None = None  # written before a Ctrl-C is forwarded (the ranks' stop reason)

    @property
    def active(self) -> bool:
        return bool(self.previous)

    def install(self) -> None:
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self.previous = {}

    def _send(self, sig: int) -> None:
        for r in list(self.live):  # exits not yet observed: at worst a zombie, never a reused pid
            pid = self.procs[r].pid
            if pid:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self._send(signal.SIGKILL)
                if not self.killed:
                    self.killed = True
                    raise KeyboardInterrupt
                return
            os.write(2, b"hpcrl: interrupted: the ranks stop at their next step boundary (checkpoint, exit 75); "
                        b"interrupt again to kill them without a checkpoint\n")
        self.requested = self.requested or signal_name(signum)
        if signum == signal.SIGINT and self.marker is not None:
            try:
                self.marker.touch()
            except OSError:  # the ranks then say SIGTERM: a worse reason, the same stop
                pass
        self._send(signal.SIGTERM if signum == signal.SIGINT else signum)
