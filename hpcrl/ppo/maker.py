"""The experience maker: collect rollouts with the newest weights it holds, on credit.

Three paths at once: compute on the main thread (:meth:`Maker.run`), and on background threads the
credit receiver, the experience sender and the weight receiver (gloo/NCCL calls release the GIL).
Weights arrive into a fresh shadow buffer and are swapped in only between rollouts: inference never
waits for a transfer and never runs on mixed weights. No lock is held across a communication call.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from hpcrl import ops
from hpcrl.comm import DistContext
from hpcrl.comm.heartbeat import PeerLost, Watcher, bounded, describe, liveness_store

from .channels import (Credit, CreditChannel, ExperienceChannel, Header, Schema, SchemaChannel, StatusChannel,
                       WeightChannel)
from .config import DetachedConfig
from .events import Events, RolloutDone
from .role_planes import RolePlanes
from .topology import Topology
from .workload import Workload

__all__ = ["Dropped", "Maker", "maker_seed"]


class Dropped(RuntimeError):
    """This maker was declared lost by the trainers (it froze past the heartbeat timeout), or the run
    finished while it was away."""


def maker_seed(seed: int, m: int) -> int:
    # Maker 0 uses exactly the synchronous loop's seeds (hpcrl.ppo.sync), so --lag 0 with 1:1 matches it.
    return seed + 1000 * m


@dataclass
class _Shadow:
    """Newest fully received weights, handed from the weight thread to the compute thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)
    version: int = -1
    flat: torch.Tensor | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)


class Maker:
    def __init__(self, ctx: DistContext, top: Topology, cfg: DetachedConfig, workload: Workload, planes: RolePlanes,
                 events: Events) -> None:
        self.ctx, self.top, self.cfg, self.workload, self.events = ctx, top, cfg, workload, events
        self.index = top.maker_index(ctx.rank)
        self.device = ctx.device
        self.model = workload.build_maker_model(cfg.seed, self.device)  # e.g. an RLHF actor without its critic
        self.tensors = workload.publish_tensors(self.model)
        self.version = 0
        self.collector = workload.make_collector(maker_seed(cfg.seed, self.index), self.device)
        self.generator = torch.Generator().manual_seed(maker_seed(cfg.seed, self.index) + 1)
        self.credits = CreditChannel(planes.exchange, top.trainers)
        self.experience = ExperienceChannel(planes.exchange)
        self.schema = SchemaChannel(ctx.store)
        numel = sum(t.numel() for t in self.tensors)
        dtype = self.tensors[0].dtype
        self.weights = WeightChannel(planes.weights, planes.exchange, ctx.store, numel, dtype,
                                     cfg.bucket_numel(dtype), cfg.timeout_s)
        live = liveness_store(ctx.store, cfg.heartbeat_timeout_s)
        self.status = StatusChannel(ctx.store, live=live)  # its queries under a deadline use the liveness client
        self.watch = Watcher(live, list(range(top.trainers)), cfg.heartbeat_timeout_s)
        self._credit_q: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue(maxsize=2)
        self._shadow = _Shadow()
        self._send_error: list[BaseException] = []
        self._produced = 0
        self._threads = [
            threading.Thread(target=self._credit_loop, name="credits-in", daemon=True),
            threading.Thread(target=self._send_loop, name="experience-out", daemon=True),
            threading.Thread(target=self._weight_loop, name="weights-in", daemon=True),
        ]

    # the compute path: the whole loop -----------------------------------------------------------
    def run(self) -> dict[str, float]:
        for t in self._threads:
            t.start()
        try:
            return self._loop()
        except Dropped as err:  # woke up after a freeze: the run went on (or ended) without us; leave quietly
            print(f"hpcrl.ppo: {err}", flush=True)
            try:
                bounded(lambda: self.status.done(self.index), self.cfg.heartbeat_timeout_s)
            except Exception:  # the trainers are gone already
                pass
            return {"produced": float(self._produced), "dropped": 1.0}
        finally:
            self.collector.close()

    def _loop(self) -> dict[str, float]:
        schema: Schema | None = None
        seq = 0
        waiting_s = 0.0
        prev_end: float | None = None  # when the previous rollout finished
        while True:
            t0 = time.monotonic()
            credit = self._next_credit()
            if credit is None:  # STOP
                break
            self._wait_for_version(credit.min_version)
            t_collect = time.monotonic()
            waiting_s += t_collect - t0
            # the credit numbers the run's batch (a dataset's collector serves a fixed slice of it)
            self.collector.assign(credit.credit_id * self.top.trainers + credit.trainer, self.cfg.seed)
            batch, stats = self.collector.collect(self.model, self.generator)
            # Timing travels with the batch so the trainers can log the makers' idle fraction: wait = since
            # the previous rollout ended (packing, send queue, credit, weights), busy = collecting this one.
            wait_start = t0 if prev_end is None else prev_end
            prev_end = time.monotonic()
            stats = {**stats, "maker_wait_s": t_collect - wait_start, "maker_busy_s": prev_end - t_collect}
            if schema is None:  # every maker announces its layout: the trainers size receives by it
                schema = Schema.of(batch, stats, self.collector.ragged())
                self.schema.announce(self.ctx.rank, schema)
            samples = int(stats.get("env_steps", 1))
            payload = schema.pack(batch, stats)
            header = Header(self.index, credit.credit_id, seq, self.version, samples, payload.numel())
            # Counted before it leaves: a maker killed right after a send must not have had a batch used
            # that its published count does not hold yet (lost in flight would go negative).
            self._produced += samples
            self._count(samples)
            self._hand_over((credit.trainer, header, payload))  # trainer index == its rank
            seq += 1
            wall = time.time() - prev_end  # monotonic instants as wall-clock times, for the event
            self.events(RolloutDone(wall + prev_end, self.index, self.version, wall + wait_start, wall + t_collect,
                                    samples))
        self._hand_over(None)  # the sender closes every trainer's stream, then ends
        self.status.done(self.index)  # before the joins: trainer 0 waits for it
        for thread in self._threads:
            thread.join(timeout=self.cfg.timeout_s)
        return {"produced": float(self._produced), "batches": float(seq), "wait_s": waiting_s}

    def _count(self, samples: int) -> None:
        """Samples counted in the store as they leave, so a lost maker's count outlives it."""
        try:
            bounded(lambda: self.status.count(self.index, samples), self.cfg.heartbeat_timeout_s)
        except Exception as err:  # unresponsive or gone: the store lives with trainer 0 (or the launcher)
            self._check_trainers("the store")  # names a dead trainer if that is what happened
            raise PeerLost(f"maker {self.index}: lost the rendezvous store hosted by "
                           f"{describe(self.ctx, 0, 'trainer')}: {err}") from None

    def _hand_over(self, item) -> None:
        """To the sender thread (a queue of two: back-pressure), failing if the sender has died."""
        while True:
            if self._send_error:
                raise PeerLost(f"maker {self.index}: sending experience failed: {self._send_error[0]}")
            try:
                self._outbox.put(item, timeout=0.5)
                return
            except queue.Full:
                self._check_trainers("room in the send queue")

    # background paths ---------------------------------------------------------------------------
    def _credit_loop(self) -> None:
        while True:
            try:
                credit = self.credits.receive()
            except Exception as err:  # a trainer vanished or sent garbage; the compute path names it
                self._credit_q.put(err)
                return
            self._credit_q.put(credit)
            if credit is None:
                return

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    for t in range(self.top.trainers):
                        self.experience.end(t)
                    return
                self.experience.send(*item)
            except Exception as err:
                self._send_error.append(err)
                return

    def _weight_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            try:
                got = self.weights.receive(newer_than=self._shadow.version)
                if got is not None:
                    version, flat = got
                    flat = flat.to(self.device)  # staged through host memory when the plane is gloo
            except Exception as err:
                with self._shadow.lock:
                    self._shadow.error = err
                    self._shadow.arrived.notify_all()
                return
            if got is None:  # the publisher closed the stream
                return
            with self._shadow.lock:  # only a pointer swap under the lock
                self._shadow.version, self._shadow.flat = version, flat
                self._shadow.arrived.notify_all()

    # helpers of the compute path ----------------------------------------------------------------
    def _swap_in(self) -> None:
        """Between rollouts: adopt the newest complete weights (never a partial transfer)."""
        with self._shadow.lock:
            version, flat = self._shadow.version, self._shadow.flat
        if flat is not None and version > self.version:
            ops.unflatten_(flat, self.tensors)
            self.workload.after_publish(self.model)
            self.collector.load_weights(self.model, version)  # into the collector's engine, where it has one
            self.version = version

    def _wait_for_version(self, min_version: int) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            self._swap_in()
            if self.version >= min_version:
                return
            with self._shadow.lock:
                broken = self._shadow.error
                if broken is None:
                    self._shadow.arrived.wait(timeout=0.5)
            self._check_trainers(f"weights v{min_version}")  # first: dropped while frozen explains a broken stream
            if broken is not None:
                raise PeerLost(f"maker {self.index}: weight stream from {describe(self.ctx, 0, 'trainer')} broke: "
                               f"{broken}")
            if time.monotonic() > deadline:
                raise PeerLost(f"maker {self.index}: no weights v{min_version} from "
                               f"{describe(self.ctx, 0, 'trainer')} within {self.cfg.timeout_s:.0f} s")

    def _check_trainers(self, waiting_for: str, finished_ok: bool = False) -> bool:
        """Raise if this maker must stop (dropped; the run finished; a trainer or the store lost). With
        ``finished_ok`` a finished run returns True instead: waiting for a credit, it is the STOP credit
        on its way (trainer 0 marks the run finished just before sending it), and the maker ends as at
        STOP, closing its streams, rather than leave them open for the trainers to time out on."""
        try:
            dropped, finished = bounded(lambda: (self.status.dropped(self.index), self.status.finished()),
                                        self.cfg.heartbeat_timeout_s)
            if dropped:
                raise Dropped(f"maker {self.index}: the trainers dropped this maker (its heartbeat stalled for more "
                              f"than {self.cfg.heartbeat_timeout_s:g} s, e.g. while frozen); its rollouts were "
                              "given to the others, so it stops here")
            if finished and finished_ok:
                return True
            if finished:
                raise Dropped(f"maker {self.index}: the run finished while this maker waited for {waiting_for}; "
                              "stopping")
            dead = self.watch.dead()
        except Dropped:
            raise
        except Exception as err:  # the store lives on trainer 0: losing it means losing trainer 0
            raise PeerLost(f"maker {self.index}: lost the rendezvous store hosted by "
                           f"{describe(self.ctx, 0, 'trainer')} while waiting for {waiting_for}: {err}") from None
        if dead:
            names = ", ".join(describe(self.ctx, r, "trainer") for r in dead)
            raise PeerLost(f"maker {self.index}: {names} stopped responding (no heartbeat for "
                           f"{self.cfg.heartbeat_timeout_s:.0f} s) while waiting for {waiting_for}", peer=dead[0])
        return False

    def _next_credit(self) -> Credit | None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                item = self._credit_q.get(timeout=0.5)
            except queue.Empty:
                if self._check_trainers("a credit", finished_ok=True):
                    return None  # as at STOP
                if time.monotonic() > deadline:
                    raise PeerLost(f"maker {self.index}: no credit from any trainer within {self.cfg.timeout_s:.0f} s")
                continue
            if isinstance(item, BaseException):
                self._check_trainers("a credit")
                raise PeerLost(f"maker {self.index}: credit channel failed: {item}")
            return item
