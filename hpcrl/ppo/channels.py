"""The three channels of detached PPO: the only place in ``hpcrl.ppo`` that sends, receives or broadcasts.

The message formats, every store key and the store handshakes (schema, a maker's life records,
placements, barrier names) live in :mod:`hpcrl.ppo.wire`, which this module owns and re-exports.

Each channel owns its plane (:mod:`hpcrl.comm.planes`), tags, tensor layout, end-of-stream marker,
timeouts and the bounds checks of what it receives; a bad message raises :class:`ChannelError`
naming the sending rank before anything is allocated from it.

* :class:`CreditChannel` — trainer -> maker, host plane: int64 ``[trainer, min_version, credit_id]``
  ("you may start one rollout, with weights of at least this version, and send it to me as
  credit_id"); ``trainer = -1`` is the end of the stream (STOP).
* :class:`ExperienceChannel` — maker -> trainer, host plane: an int64 :class:`Header` then ONE packed
  byte buffer holding every tensor of the batch and its rollout stats (:class:`Schema`). Experience
  is packed where the batch lives, copied to the maker's host once, and moved to the trainer's device
  on arrival, whatever the two devices are; ``maker = -1`` ends a stream. A schema with ragged fields
  (the ``hf`` workload's padded tokens and masks) sends each row's span only: its payloads vary in
  size, within the schema's bounds, and their spans are checked on arrival.
* :class:`WeightChannel` — trainer 0 -> every maker: per version a header ``[version, buckets,
  checksum, numel]`` and the flat weights in buckets, as ONE bucketed broadcast over the weight
  plane (trainer 0 + makers). That plane is NCCL when trainer 0 and every maker sit on distinct GPUs;
  otherwise (a CPU side, or a maker sharing trainer 0's GPU, which NCCL refuses) it is gloo and the
  weights are staged through host memory, leaving the trainer's device once per version. Makers
  receive into a fresh shadow buffer (see :mod:`hpcrl.ppo.maker`). If a broadcast cannot complete
  (a maker died or hangs), the publisher switches the channel to point-to-point sends over the host
  plane for the rest of the run and says so through the store, so one lost maker never stops the
  others' weights; version ``-1`` ends the stream.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hpcrl.comm import Plane, abort

from .wire import (FALLBACK_KEY, MAX_PAYLOAD_BYTES, ChannelError, Credit, Header, Schema, SchemaChannel, StatusChannel,
                   checksum)

__all__ = ["ChannelError", "Credit", "CreditChannel", "ExperienceChannel", "Header", "Schema", "SchemaChannel",
           "StatusChannel", "WeightChannel", "checksum"]

TAG_CREDIT, TAG_HEADER, TAG_PAYLOAD, TAG_WEIGHTS = 11, 12, 13, 14
END = -1  # in a credit's trainer field, a header's maker field, a weight header's version: stream ends
# Completion poll of a pending broadcast (is_completed(): a flag read), backing off from 0.2 ms: to 1 ms
# while a transfer is in flight, to 5 ms while a maker idles until the next version's header.
_POLL_MIN_S, _POLL_BUSY_S, _POLL_IDLE_S = 0.0002, 0.001, 0.005
_LOOK_S = 0.25  # how often a waiting broadcast checks liveness (publisher) or the fallback key (maker)


# ----------------------------------------------------------------------------------------- credits


class CreditChannel:
    """Trainer -> maker credits over the host plane (``plane``: the world's host plane)."""

    def __init__(self, plane: Plane, trainers: int) -> None:
        self.plane, self.trainers = plane, trainers
        self._buf = torch.empty(3, dtype=torch.int64)

    # Both sends are posted, not waited for: a gloo send completes only once the receiver has posted its
    # receive, so a frozen maker would hold the trainer's main thread, which is what watches for one.
    # The caller keeps the returned (work, tensor) until the work completes.

    def grant(self, maker_rank: int, credit: Credit) -> tuple[dist.Work, torch.Tensor]:
        msg = torch.tensor([credit.trainer, credit.min_version, credit.credit_id], dtype=torch.int64)
        return dist.isend(msg, maker_rank, group=self.plane.group, tag=TAG_CREDIT), msg

    def stop(self, maker_rank: int) -> tuple[dist.Work, torch.Tensor]:
        msg = torch.tensor([END, 0, 0], dtype=torch.int64)
        return dist.isend(msg, maker_rank, group=self.plane.group, tag=TAG_CREDIT), msg

    def receive(self) -> Credit | None:
        """The next credit from any trainer (blocking), or None at STOP."""
        src = dist.recv(self._buf, group=self.plane.group, tag=TAG_CREDIT)
        trainer, min_version, credit_id = (int(x) for x in self._buf.tolist())
        if trainer == END:
            return None
        if not (0 <= trainer < self.trainers and trainer == src and min_version >= 0 and credit_id >= 0):
            raise ChannelError(f"credit from rank {src}: trainer {trainer}, min version {min_version}, id "
                               f"{credit_id} (need the sender's own trainer index < {self.trainers}, values >= 0)")
        return Credit(trainer, min_version, credit_id)


# -------------------------------------------------------------------------------------- experience


class ExperienceChannel:
    """Maker -> trainer experience over the host plane. ``schema`` (trainer side) gives, per sender rank,
    the payload size a header may announce (exactly ``nbytes``; up to it with ragged fields) and the
    check of a received payload (:meth:`Schema.check_payload`: a ragged one's spans); ``max_version``
    (trainer side) returns the newest version any maker can hold."""

    def __init__(self, plane: Plane, schema: Callable[[int], Schema] | None = None,
                 max_version: Callable[[], int] | None = None, maker_index: Callable[[int], int] | None = None,
                 max_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self.plane, self._schema, self._max_version, self._maker_index = plane, schema, max_version, maker_index
        self.max_bytes = max_bytes

    def send(self, trainer_rank: int, header: Header, payload: torch.Tensor) -> None:
        self.plane.check([payload], "experience payload")
        dist.send(header.tensor(), trainer_rank, group=self.plane.group, tag=TAG_HEADER)
        dist.send(payload, trainer_rank, group=self.plane.group, tag=TAG_PAYLOAD)

    def end(self, trainer_rank: int) -> None:
        dist.send(Header(END, 0, 0, 0, 0, 0).tensor(), trainer_rank, group=self.plane.group, tag=TAG_HEADER)

    def check(self, h: Header, src: int) -> None:
        """Raise ChannelError naming ``src`` unless ``h`` is a header this trainer can accept."""
        assert self._schema is not None and self._max_version is not None and self._maker_index is not None
        problems = []
        if h.maker != self._maker_index(src):
            problems.append(f"maker index {h.maker}, but rank {src} is maker {self._maker_index(src)}")
        if not 0 <= h.nbytes <= self.max_bytes:
            problems.append(f"payload of {h.nbytes} bytes (limit {self.max_bytes})")
        elif not self._schema(src).ragged and h.nbytes != self._schema(src).nbytes:
            problems.append(f"payload of {h.nbytes} bytes, the schema says {self._schema(src).nbytes}")
        elif not self._schema(src).min_nbytes <= h.nbytes <= self._schema(src).nbytes:
            problems.append(f"payload of {h.nbytes} bytes, the schema's ragged batches take "
                            f"{self._schema(src).min_nbytes} to {self._schema(src).nbytes}")
        if not 0 <= h.version <= self._max_version():
            problems.append(f"unknown policy version {h.version} (newest published: {self._max_version()})")
        if h.samples < 0 or h.credit < 0 or h.seq < 0:
            problems.append(f"negative samples / credit / sequence number ({h.samples}, {h.credit}, {h.seq})")
        if problems:
            raise ChannelError(f"experience header from rank {src} refused: " + "; ".join(problems))

    def receive(self, maker_rank: int) -> tuple[Header, torch.Tensor] | None:
        """The next (header, payload) from one maker (blocking), or None when its stream ends; a header or
        payload out of the schema's bounds raises ChannelError naming the rank."""
        buf = torch.empty(6, dtype=torch.int64)
        dist.recv(buf, maker_rank, group=self.plane.group, tag=TAG_HEADER)
        h = Header.from_tensor(buf)
        if h.maker == END:
            return None
        self.check(h, maker_rank)
        payload = torch.empty(h.nbytes, dtype=torch.uint8)
        dist.recv(payload, maker_rank, group=self.plane.group, tag=TAG_PAYLOAD)
        self._schema(maker_rank).check_payload(payload, f"rank {maker_rank}")  # a ragged one's spans, before use
        return h, payload


# ----------------------------------------------------------------------------------------- weights


class _Copies:
    """The publisher's point-to-point copies: one sender thread per maker rank, each sending the newest
    version it was handed (a one-slot mailbox: a newer version replaces one not started yet). A frozen
    maker blocks only its own sender, holds at most the copy in flight and the newest one, and is
    reported once its copy fails or does not land within ``timeout_s``."""

    def __init__(self, host: Plane, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self._cv = threading.Condition()
        self._slots: dict[int, list[torch.Tensor]] = {}  # maker rank -> [head, *buckets] to send next
        self._delivered: dict[int, float] = {}  # maker rank -> the version its last landed copy carried
        self._failed: set[int] = set()
        self._unreported: list[int] = []
        self._senders: dict[int, threading.Thread] = {}

    def post(self, dst: int, tensors: list[torch.Tensor]) -> None:
        with self._cv:
            if dst in self._failed:
                return
            self._slots[dst] = tensors
            if dst not in self._senders:
                self._senders[dst] = threading.Thread(target=self._send_loop, args=(dst,), daemon=True,
                                                      name=f"weights-to-{dst}")
                self._senders[dst].start()
            self._cv.notify_all()

    def take_failed(self) -> list[int]:
        with self._cv:
            found, self._unreported = self._unreported, []
        return found

    def wait_delivered(self, makers: list[int], version: float, timeout_s: float) -> None:
        """Until every maker in ``makers`` got ``version`` or failed (one deadline)."""
        with self._cv:
            self._cv.wait_for(lambda: all(self._delivered.get(d) == version or d in self._failed for d in makers),
                              timeout=timeout_s)

    def _send_loop(self, dst: int) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: dst in self._slots)
                tensors = self._slots.pop(dst)
            try:
                works = [dist.isend(t, dst, group=self.host.group, tag=TAG_WEIGHTS) for t in tensors]
                deadline = time.monotonic() + self.timeout_s
                for w in works:
                    w.wait(timedelta(seconds=max(0.01, deadline - time.monotonic())))
            except Exception:  # gone, or frozen past the timeout: no more copies for it
                with self._cv:
                    self._failed.add(dst)
                    self._unreported.append(dst)
                    self._cv.notify_all()
                return
            with self._cv:
                self._delivered[dst] = float(tensors[0][0])
                self._cv.notify_all()
            if float(tensors[0][0]) == END:
                return


class WeightChannel:
    """Trainer 0 -> makers. ``plane``: the weight plane (trainer 0 + makers; NCCL or gloo), ``host``:
    the world's host plane (point-to-point fallback), ``store``: the rendezvous store (fallback flag).
    ``numel`` / ``dtype``: the flat weight vector every version carries; ``timeout_s`` bounds one delivery.
    ``transport="point-to-point"`` starts in the fallback mode (one copy per maker over the host plane:
    the pre-broadcast design, kept for comparison); both ends must pass the same."""

    def __init__(self, plane: Plane, host: Plane, store: dist.Store, numel: int, dtype: torch.dtype,
                 bucket_numel: int, timeout_s: float, transport: str = "broadcast") -> None:
        if transport not in ("broadcast", "point-to-point"):
            raise ValueError(f"transport must be 'broadcast' or 'point-to-point', not {transport!r}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        self.plane, self.host, self.store = plane, host, store
        self.numel, self.dtype, self.bucket = numel, dtype, bucket_numel
        self.buckets = max(1, math.ceil(numel / bucket_numel))
        self.timeout_s = timeout_s
        self.src = plane.ranks[0]
        self.point_to_point = transport == "point-to-point"
        self.transport = transport
        self._copies = _Copies(host, timeout_s)  # the publisher's point-to-point senders

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    # publisher ---------------------------------------------------------------------------------
    def publish(self, flat: torch.Tensor, version: int, makers: list[int],
                alive: Callable[[], bool] = lambda: True) -> list[int]:
        """Deliver ``flat`` (any device; moved to the plane's device once) as ``version`` to the live
        ``makers`` (global ranks); returns the ranks it could not reach (point-to-point mode).
        ``alive()`` returns False once a maker of the plane is known lost (asked while a broadcast waits)."""
        if flat.numel() != self.numel or flat.dtype != self.dtype:
            raise ValueError(f"weights v{version}: {flat.numel()} x {flat.dtype}, the channel carries "
                             f"{self.numel} x {self.dtype}")
        header = [float(version), float(self.buckets), checksum(flat), float(self.numel)]
        if not self.point_to_point and not alive():
            self._fall_back(version)  # a broadcast over a group with a dead member cannot complete
        if not self.point_to_point:
            staged = flat.to(self.plane.device)  # the weights leave the trainer's device once per version
            if self._broadcast(staged, header, alive):
                return []
            self._fall_back(version)
        return self._send_each(flat.to("cpu"), header, makers)

    def end(self, makers: list[int], alive: Callable[[], bool] = lambda: True) -> None:
        """Close the stream (best effort: makers that are gone are skipped, within one deadline)."""
        header = [float(END), 0.0, 0.0, 0.0]
        if not self.point_to_point and alive() and self._broadcast(None, header, alive):
            return
        if not self.point_to_point:
            self._fall_back(END)
        self._end_each(makers)

    def _fall_back(self, version: int) -> None:
        """From now on point-to-point over the host plane; every member learns it from the store and
        aborts the weight plane, so no pending broadcast is left to a watchdog."""
        self.point_to_point, self.transport = True, "point-to-point"
        self.store.set(FALLBACK_KEY, str(version))
        abort(self.plane)

    def _send_each(self, flat: torch.Tensor, header: list[float], makers: list[int],
                   buckets: int | None = None) -> list[int]:
        """Hand one copy per maker to its sender (:class:`_Copies`) without waiting; returns the makers a
        copy failed to reach (or did not reach within the timeout) since the last call."""
        head = torch.tensor(header, dtype=torch.float64)
        parts = [flat[i * self.bucket : (i + 1) * self.bucket] for i in range(self.buckets if buckets is None else buckets)]
        for dst in makers:
            self._copies.post(dst, [head, *parts])
        return self._copies.take_failed()

    def _end_each(self, makers: list[int]) -> None:
        """The end marker to every live maker (each after its last copy), within one deadline."""
        self._send_each(torch.zeros(0, dtype=self.dtype), [float(END), 0.0, 0.0, 0.0], makers, buckets=0)
        self._copies.wait_delivered(makers, float(END), self.timeout_s)

    def _wait(self, works: list, alive: Callable[[], bool] | None, max_nap_s: float = _POLL_BUSY_S) -> bool:
        """Poll the works until done (True), or False when the channel must give up on broadcasts: on the
        publisher (``alive`` given) when a maker is lost, a work failed, or the delivery is past its
        deadline; on a maker (``alive`` None) only when the publisher said so through the store (a failed
        work there is an error)."""
        publisher = alive is not None
        deadline = time.monotonic() + self.timeout_s
        next_look = time.monotonic() + _LOOK_S
        nap = _POLL_MIN_S
        while True:
            try:
                if all(w.is_completed() for w in works):
                    for w in works:
                        w.wait()  # raises the error of a failed work
                    return True
            except Exception:
                if publisher:
                    return False
                # A member of the weight plane died (gloo fails pending ops of the whole group): the
                # publisher notices within the heartbeat timeout and falls back; wait for its word.
                give_up = time.monotonic() + self.timeout_s
                while time.monotonic() < give_up:
                    if self.store.check([FALLBACK_KEY]):
                        return False
                    time.sleep(_LOOK_S)
                raise
            now = time.monotonic()
            if now >= next_look:  # the liveness / store look is rarer than the poll: M makers share one store
                next_look = now + _LOOK_S
                if alive is not None and not alive():
                    return False
                if not publisher and self.store.check([FALLBACK_KEY]):
                    return False
            if publisher and now > deadline:
                return False
            time.sleep(nap)
            nap = min(2 * nap, max_nap_s)

    def _broadcast(self, staged: torch.Tensor | None, header: list[float], alive: Callable[[], bool]) -> bool:
        if staged is not None:
            self.plane.check([staged], "weights")
        head = torch.tensor(header, dtype=torch.float64, device=self.plane.device)
        works = [dist.broadcast(head, self.src, group=self.plane.group, async_op=True)]
        if staged is not None:
            buckets = [staged[i * self.bucket : (i + 1) * self.bucket] for i in range(self.buckets)]
            works += [dist.broadcast(b, self.src, group=self.plane.group, async_op=True) for b in buckets]
        return self._wait(works, alive)

    # maker -------------------------------------------------------------------------------------
    def receive(self, newer_than: int) -> tuple[int, torch.Tensor] | None:
        """The next version (blocking) as ``(version, flat)`` on the plane's device (a fresh
        buffer), or None at the end of the stream. Checks bounds and the checksum."""
        while True:
            if not self.point_to_point:
                got = self._receive_broadcast()
                if got is None:  # the publisher fell back to point-to-point: so do we
                    self.point_to_point, self.transport = True, "point-to-point"
                    abort(self.plane)
                    continue
            else:
                got = self._receive_point_to_point()
            header, flat = got
            version = int(header[0])
            if version == END:
                return None
            if flat is None or version <= newer_than:
                continue  # an old version re-sent after the switch to point-to-point
            if checksum(flat) != header[2]:
                raise ChannelError(f"weights v{version} from rank {self.src}: checksum mismatch (corrupted transfer)")
            return version, flat

    def _check_header(self, header: list[float]) -> None:
        version, buckets, _, numel = header
        if not all(math.isfinite(x) for x in (version, buckets, numel)):
            raise ChannelError(f"weights header from rank {self.src} refused: non-finite {header}")
        if int(version) == END:
            return
        if not (int(numel) == self.numel and int(buckets) == self.buckets and version >= 0
                and version == int(version)):
            raise ChannelError(f"weights header from rank {self.src} refused: version {version}, {int(buckets)} "
                               f"buckets of {int(numel)} values (this channel carries {self.numel} values in "
                               f"{self.buckets} buckets)")

    def _receive_broadcast(self) -> tuple[list[float], torch.Tensor | None] | None:
        head = torch.empty(4, dtype=torch.float64, device=self.plane.device)
        if not self._wait([dist.broadcast(head, self.src, group=self.plane.group, async_op=True)], None, _POLL_IDLE_S):
            return None
        header = head.tolist()
        self._check_header(header)
        if int(header[0]) == END:
            return header, None
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.plane.device)
        works = [dist.broadcast(flat[i * self.bucket : (i + 1) * self.bucket], self.src, group=self.plane.group,
                                async_op=True) for i in range(self.buckets)]
        if not self._wait(works, None):
            return None
        return header, flat

    def _receive_point_to_point(self) -> tuple[list[float], torch.Tensor | None]:
        head = torch.empty(4, dtype=torch.float64)
        dist.recv(head, self.src, group=self.host.group, tag=TAG_WEIGHTS)
        header = head.tolist()
        self._check_header(header)
        if int(header[0]) == END:
            return header, None
        flat = torch.empty(self.numel, dtype=self.dtype)
        for i in range(self.buckets):
            dist.recv(flat[i * self.bucket : (i + 1) * self.bucket], self.src, group=self.host.group, tag=TAG_WEIGHTS)
        return header, flat
