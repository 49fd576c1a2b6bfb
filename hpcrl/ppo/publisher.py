"""Trainer 0's weight publisher: a one-slot mailbox and the thread that empties it into the weight channel.

A one-slot mailbox, not a queue: a busy publisher must not pile up model copies (GPU memory), and
only the newest version matters. The main thread posts snapshots and tells the publisher which
makers are live; the thread keeps the makers it could not reach and its error for the main thread
to collect (:meth:`Publisher.unreachable`, :meth:`Publisher.check`).

The end of the stream is never held by one maker: once it is posted, a broadcast still waiting (the
last version's, or the end marker's own) gives up after :data:`END_WAIT_S` and the end goes
point-to-point to each maker. At that point every live maker sits idle in the header's receive (the
drain has collected their last rollouts), so a broadcast that has not completed is one a maker froze
or died in, which the trainer may learn only after its heartbeat timeout, or (after the drain) not
at all in time for the publisher.
"""

from __future__ import annotations

import threading
import time

import torch

from hpcrl.comm.heartbeat import PeerLost

from .channels import WeightChannel
from .events import Events, WeightsPublished

__all__ = ["END_WAIT_S", "Publisher"]

END_WAIT_S = 2.0  # how long a broadcast may still wait once the end of the stream is posted


class Publisher:
    """Publishes to the maker ranks ``makers`` over ``weights``; ``device``: where the snapshots live."""

    def __init__(self, weights: WeightChannel, makers: list[int], device: torch.device, events: Events) -> None:
        self.weights, self.device, self.events = weights, device, events
        self._makers = len(makers)
        self._live = list(makers)  # rebound, never changed in place: the thread reads it
        self._mailbox: list = []  # [] empty, [(version, flat)] a snapshot, [None] end of stream
        self._mail = threading.Condition()
        self._latest: tuple[int, torch.Tensor] | None = None  # the newest snapshot posted
        self._unreachable: list[int] = []  # maker ranks a publish could not reach, not yet collected
        self.error: BaseException | None = None
        self.publish_ms = float("nan")
        self._end_at: float | None = None  # when the end of the stream was posted (monotonic)
        self._since = 0.0  # when the thread's current delivery began
        self._thread = threading.Thread(target=self._loop, name="weights-out", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check(self) -> None:
        """Raise what the thread hit (it ended there)."""
        if self.error is not None:
            raise PeerLost(f"trainer 0: publishing weights to the makers failed: {self.error}")

    def post(self, version: int, flat: torch.Tensor) -> None:
        """The newest version (a fresh tensor: a snapshot the next update cannot change)."""
        self.check()
        self._latest = (version, flat)
        self._put(self._latest)

    def republish(self) -> None:
        """Post the newest snapshot again (None yet: the makers hold v0 from their own build)."""
        self.check()
        if self._latest is not None:
            self._put(self._latest)

    def set_live(self, makers: list[int]) -> None:
        """The maker ranks publishes go to from now on; fewer than at the start makes a broadcast give up."""
        self._live = list(makers)

    def end(self) -> None:
        """The end of the stream, after the last version."""
        self._end_at = time.monotonic()
        self._put(None)

    def unreachable(self) -> list[int]:
        """The maker ranks publishes could not reach since the last call."""
        with self._mail:
            found, self._unreachable = self._unreachable, []
        return found

    def _alive(self) -> bool:
        """Whether a broadcast may go on waiting: every maker live, and the end not posted for more than
        END_WAIT_S of this delivery."""
        if len(self._live) != self._makers:
            return False
        end = self._end_at
        return end is None or time.monotonic() - max(end, self._since) < END_WAIT_S

    def _put(self, item) -> None:
        with self._mail:
            if self._mailbox != [None]:  # only the newest version matters; the end marker stays
                self._mailbox[:] = [item]
            self._mail.notify()

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._mail:
                self._mail.wait_for(lambda: bool(self._mailbox))
                item = self._mailbox.pop()
            self._since = time.monotonic()
            if item is None:
                self.weights.end(self._live, self._alive)
                return
            if not self._publish(*item):
                return

    def _publish(self, version: int, flat: torch.Tensor) -> bool:
        """One version to the live makers; False (the error kept for the main thread) if that failed."""
        live, t0, before = self._live, time.perf_counter(), self.weights.transport
        try:
            failed = self.weights.publish(flat, version, live, self._alive)
        except Exception as err:  # the main thread raises it at its next post
            self.error = err
            return False
        seconds = time.perf_counter() - t0
        self.publish_ms = seconds * 1000
        self._lose(failed)
        if self.weights.transport != before and self._end_at is None:  # at the end: nobody needs the news
            # a count only once the trainers dropped the lost maker: a broadcast may fail before they know
            to = f"the {len(self._live)} live maker(s)" if len(self._live) < self._makers else "each live maker"
            print(f"hpcrl.ppo: the weight broadcast to the makers could not complete at v{version} (a maker is "
                  f"lost or hangs); weights go {self.weights.transport} to {to} from now on", flush=True)
        self.events(WeightsPublished(time.time(), version, seconds, self.weights.nbytes, len(live),
                                     self.weights.transport))
        return True

    def _lose(self, failed: list[int]) -> None:
        """No more weights for them; the trainer drops them (and re-issues their credits)."""
        if failed:
            with self._mail:
                self._unreachable += failed
                self._live = [r for r in self._live if r not in failed]
