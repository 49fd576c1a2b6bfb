"""Preemption: a signal asks a job to stop; its ranks agree on it at a step boundary."""

from __future__ import annotations

import os
import signal
import threading

import torch

from hpcrl.core.conventions import EXIT_STOPPED

from .planes import Plane
from .reduce import all_reduce_sum_

__all__ = ["EXIT_STOPPED", "INTERRUPT_ENV", "StopRequest"]

INTERRUPT_ENV = "HPCRL_INTERRUPT_FILE"
"""Set by :func:`hpcrl.comm.spawn`: a file that exists once the SIGTERM a rank gets is a forwarded Ctrl-C."""


class StopRequest:
    """SIGUSR2 (Slurm's ``--signal=USR2@<s>``; NCCL owns USR1) or SIGTERM asks the run to stop cleanly:
    the ranks agree at the next step boundary (:meth:`agreed`), checkpoint there and exit
    ``EXIT_STOPPED``, so ``--resume`` (or a requeued job) continues where this one stopped."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.reason = ""
        self.faults = 0  # ranks that reported a fault in the last agreement

    @classmethod
    def install(cls) -> "StopRequest":
        req = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in cls.SIGNALS:
                signal.signal(sig, req._handle)
        return req

    def _handle(self, signum, _frame) -> None:
        marker = os.environ.get(INTERRUPT_ENV)
        ctrl_c = signum == signal.SIGTERM and marker and os.path.exists(marker)
        self.reason = "Ctrl-C" if ctrl_c else signal.Signals(signum).name

    def agreed(self, plane: Plane, fault: bool = False) -> bool:
        """True on every rank of a host ``plane`` if any of them was signalled (one tiny gloo
        all-reduce of a CPU flag: never on the device plane, where NCCL refuses CPU tensors).

        ``fault``: this rank must stop for a reason of its own (e.g. unusable env data); the same
        all-reduce counts them, so afterwards :attr:`faults` (the number of ranks with one) is the same
        on every rank and all can stop together instead of leaving peers blocked in a collective."""
        if plane.name != "host":
            raise ValueError(f"StopRequest.agreed runs on the host plane, got the {plane}")
        flags = torch.tensor([1.0 if self.reason else 0.0, 1.0 if fault else 0.0])
        all_reduce_sum_([flags], plane)
        stop_flag, faults = flags.tolist()  # one host read
        stop, self.faults = stop_flag > 0, int(faults)
        if stop and not self.reason:
            self.reason = "signal on another rank"
        return stop
