"""What :func:`hpcrl.comm.spawn` saw of its ranks' exits, and whom it blames: the rank whose exit it
observed first (ties: a rank killed by a signal before one that raised, then the earlier
exception), with its signal name, exit code or the exception's last line."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Sequence

from .heartbeat import PeerLost
from .spawn_errors import SpawnConfigError, SpawnDataError, SpawnError, SpawnPeerLost

if TYPE_CHECKING:
    from .spawn_signals import Forwarder


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def read_error(tmp: str, rank: int) -> dict | None:
    try:
        return json.loads(Path(tmp, f"error-{rank}").read_text())
    except (OSError, ValueError):
        return None


_LOG_TAIL = 1 << 14  # bytes of a rank's native log read for its last line
_NOISE = ("frame #", "Exception raised from")  # the C++ stack frames c10d prints after its message


def log_line(tmp: str, rank: int) -> str:
    """``; its log PATH ends: LINE``: the last line the rank's native side wrote to its log in this job
    (:func:`hpcrl.comm.spawn_child.record_log`), C++ frames skipped; "" when it wrote none."""
    try:
        where = json.loads(Path(tmp, f"log-{rank}").read_text())
        path, offset = Path(where["path"]), int(where["offset"])
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - _LOG_TAIL))
            text = f.read().decode("utf-8", errors="replace")
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(_NOISE)]
    return f"; its log {path} ends: {lines[-1][:500]}" if lines else ""


PEER_LOST = f"{PeerLost.__module__}.{PeerLost.__qualname__}"  # how a rank's error record names it


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"


class Exits:
    """What the parent saw: exits in the order it observed them, the ranks it stopped itself."""

    def __init__(self, procs: list, tmp: str, fwd: Forwarder) -> None:
        self.procs, self.tmp, self.fwd = procs, tmp, fwd
        self.order: list[int] = []
        self.stopped: set[int] = set()  # terminated / killed by spawn (after a failure, timeout, grace)

    def succeeded(self, rank: int) -> bool:
        # The result file is written last (atomically): its rank finished, whatever killed it afterwards.
        return Path(self.tmp, f"result-{rank}").exists()

    def observe(self, batch: list[int]) -> list[int]:
        """Record ranks whose sentinels fired together, in the order their failures most likely happened:
        killed by a signal (no record: a peer's exception is usually its consequence), then by exception time."""
        def key(r: int) -> tuple:
            rec = read_error(self.tmp, r)
            code = self.procs[r].exitcode
            if self.succeeded(r):
                return (2, 0.0, r)
            if rec is None and code is not None and code < 0:
                return (0, 0.0, r)
            return (1, float(rec["time"]) if rec else float("inf"), r)

        batch = sorted(batch, key=key)
        self.order += batch
        return batch

    def lost_peer(self, rank: int) -> int | None:
        """The frozen peer that ``rank``'s heartbeat watch named before ending it, if any."""
        peer = (read_error(self.tmp, rank) or {}).get("lost")
        return peer if isinstance(peer, int) and 0 <= peer < len(self.procs) else None

    def describe(self, rank: int) -> str:
        """"killed by SIGKILL" / "exit code 1: ValueError: boom" / "stopped by spawn"."""
        code = self.procs[rank].exitcode
        rec = read_error(self.tmp, rank)
        if rec is not None:
            return f"{_how(code)}: {rec['last']}"
        if rank in self.stopped:
            return "stopped by spawn"
        if code == 0:
            return "exit code 0 without returning a result"
        if code is not None and code < 0 and self.fwd.requested and -code in (signal.SIGTERM, signal.SIGUSR2):
            return f"{_how(code)}, forwarded on {self.fwd.requested}: it does not handle stop signals"
        return _how(code)

    def first(self, rank: int, lost: Collection[int] = ()) -> int:
        """``rank`` (the first failure observed), unless it raised and another rank raised earlier: that one
        (it may still have been exiting). Exception times compare; a signal death has none, so it stands."""
        mine = read_error(self.tmp, rank)
        if mine is None:
            return rank
        records = {r: rec for r in range(len(self.procs)) if r not in lost and (rec := read_error(self.tmp, r))}
        return min(records, key=lambda r: (float(records[r]["time"]), r))

    def failure(self, rank: int, lost: Sequence[int] = ()) -> SpawnError:
        rec = read_error(self.tmp, rank)
        code = self.procs[rank].exitcode
        if rec is not None and rec.get("config"):
            return SpawnConfigError(rec["message"] or rec["last"], rank, code, rec.get("type", ""))
        if rec is not None and rec.get("data"):
            return SpawnDataError(rec["message"] or rec["last"], rank, code)
        if rec is not None and "lost" in rec:  # blame the peer it named, not the rank that noticed
            return SpawnPeerLost(rec["message"], rec["lost"], code)
        earlier = [r for r in lost if r != rank]
        if rec is not None and rec.get("type") == PEER_LOST:  # an expected loss (every maker dead): one line
            text = rec["message"]
            if earlier:
                text += "; earlier, expendable " + ", ".join(f"rank {r} ({self.describe(r)})" for r in earlier)
            return SpawnError(text, rank, code)
        own = log_line(self.tmp, rank) if rec is None else ""  # no Python error: what its native side last wrote
        text = f"rank {rank} failed first ({self.describe(rank)}{own})"
        if earlier:
            text += "; earlier, expendable " + ", ".join(f"rank {r} ({self.describe(r)})" for r in earlier)
        later = [r for r in self.order if r != rank and r not in earlier and not self.succeeded(r)]
        later += [r for r in range(len(self.procs))
                  if r not in self.order and r != rank and r not in earlier and not self.succeeded(r)]
        if later:
            text += "; then " + ", ".join(f"rank {r} ({self.describe(r)})" for r in later)
        detail = (rec["traceback"] if rec is not None else "").strip()
        return SpawnError(f"{text}:\n{detail}" if detail else text, rank, code)
