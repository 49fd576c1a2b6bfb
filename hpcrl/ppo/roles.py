"""The two detached-PPO roles. Each runs three paths at once: compute on the main thread,
experience I/O and weight I/O on background threads (gloo/nccl point-to-point ops release the
GIL). Threads hand data over through queues and one small lock that is never held across a
communication call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcrl import ops
from hpcrl.dist import DistContext, GradSync

from . import transport
from .config import DetachedConfig
from .liveness import Heartbeat, Watcher
from .topology import Topology
from .workload import PPOConfig, Workload
from .transport import TAG_CREDIT, TAG_HEADER, TAG_PAYLOAD, Header, Schema

STOP = -1.0  # a credit with this trainer field tells the maker to finish


class PeerLost(RuntimeError):
    """A peer stopped responding; the message names it."""


def maker_seed(seed: int, m: int) -> int:
    # Maker 0 uses exactly the synchronous loop's seeds (hpcrl.ppo.sync), so --lag 0 with 1:1 matches it.
    return seed + 1000 * m


def _describe(ctx: DistContext, rank: int, role: str) -> str:
    host = ""
    if ctx.store is not None:
        try:
            host = ctx.store.get(f"host/{rank}").decode()
        except Exception:
            pass
    return f"{role} rank {rank}" + (f" ({host})" if host else "")


# ------------------------------------------------------------------------------------------- maker


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
    def __init__(self, ctx: DistContext, top: Topology, cfg: DetachedConfig, workload: Workload,
                 ppo: PPOConfig, weight_group) -> None:
        self.ctx, self.top, self.cfg, self.workload = ctx, top, cfg, workload
        self.weight_group = weight_group
        self.index = top.maker_index(ctx.rank)
        self.device = torch.device("cpu")
        self.model = workload.build_model(cfg.seed, self.device)
        self.sync_tensors = workload.sync_tensors(self.model)
        self.version = 0
        self.collector = workload.make_collector(maker_seed(cfg.seed, self.index), self.device)
        self.generator = torch.Generator().manual_seed(maker_seed(cfg.seed, self.index) + 1)
        self.credits: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue(maxsize=2)
        self.shadow = _Shadow()
        self.send_error: list[BaseException] = []
        self.produced = 0
        self.waiting_s = 0.0
        self.watch = Watcher(ctx.store, list(range(top.trainers)), cfg.heartbeat_timeout_s)
        bucket = max(1, int(cfg.bucket_mb * 2**20) // max(1, self.sync_tensors[0].element_size()))
        self._threads = [
            threading.Thread(target=self._credit_loop, name="credits", daemon=True),
            threading.Thread(target=self._send_loop, name="experience-out", daemon=True),
            threading.Thread(target=self._weight_loop, args=(bucket,), name="weights-in", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # background paths ----------------------------------------------------------------------------
    def _credit_loop(self) -> None:
        buf = torch.empty(3, dtype=torch.float64)
        while True:
            try:
                dist.recv(buf, tag=TAG_CREDIT)  # from any trainer
            except Exception as err:  # a trainer vanished; the compute path reports it by name
                self.credits.put(err)
                return
            trainer, min_version, credit = int(buf[0]), int(buf[1]), int(buf[2])
            self.credits.put(None if trainer == STOP else (trainer, min_version, credit))
            if trainer == STOP:
                return

    def _send_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            dst, header, payload = item
            try:
                dist.send(header, dst, tag=TAG_HEADER)
                if payload is not None:
                    dist.send(payload, dst, tag=TAG_PAYLOAD)
            except Exception as err:
                self.send_error.append(err)
                return

    def _weight_loop(self, bucket: int) -> None:
        dtype = self.sync_tensors[0].dtype
        while True:
            try:
                version, flat = transport.recv_weights(0, dtype, bucket, self.weight_group)
            except Exception as err:
                with self.shadow.lock:
                    self.shadow.error = err
                    self.shadow.arrived.notify_all()
                return
            if flat is None:  # the publisher closed the stream
                return
            with self.shadow.lock:  # only a pointer swap under the lock
                if version > self.shadow.version:
                    self.shadow.version, self.shadow.flat = version, flat
                self.shadow.arrived.notify_all()

    # compute path --------------------------------------------------------------------------------
    def _swap_in(self) -> None:
        """Between rollouts: adopt the newest complete weights (never a partial transfer)."""
        with self.shadow.lock:
            version, flat = self.shadow.version, self.shadow.flat
        if flat is not None and version > self.version:
            ops.unflatten_(flat, self.sync_tensors)
            self.workload.after_sync(self.model)
            self.version = version

    def _wait_for_version(self, min_version: int) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            self._swap_in()
            if self.version >= min_version:
                return
            with self.shadow.lock:
                if self.shadow.error is not None:
                    raise PeerLost(f"maker {self.index}: weight stream from "
                                   f"{_describe(self.ctx, 0, 'trainer')} broke: {self.shadow.error}")
                self.shadow.arrived.wait(timeout=0.5)
            self._check_trainers(f"weights v{min_version}")
            if time.monotonic() > deadline:
                raise PeerLost(f"maker {self.index}: no weights v{min_version} from "
                               f"{_describe(self.ctx, 0, 'trainer')} within {self.cfg.timeout_s:.0f} s")

    def _check_trainers(self, waiting_for: str) -> None:
        try:
            dead = self.watch.dead()
        except Exception as err:  # the store lives on trainer 0: losing it means losing trainer 0
            raise PeerLost(f"maker {self.index}: lost the rendezvous store hosted by "
                           f"{_describe(self.ctx, 0, 'trainer')} while waiting for {waiting_for}: {err}") from None
        if dead:
            names = ", ".join(_describe(self.ctx, r, "trainer") for r in dead)
            raise PeerLost(f"maker {self.index}: {names} stopped responding (no heartbeat for "
                           f"{self.cfg.heartbeat_timeout_s:.0f} s) while waiting for {waiting_for}")

    def _next_credit(self):
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                item = self.credits.get(timeout=0.5)
            except queue.Empty:
                self._check_trainers("a credit")
                if time.monotonic() > deadline:
                    raise PeerLost(f"maker {self.index}: no credit from any trainer within {self.cfg.timeout_s:.0f} s")
                continue
            if isinstance(item, BaseException):
                self._check_trainers("a credit")
                raise PeerLost(f"maker {self.index}: credit channel failed: {item}")
            return item

    def run(self) -> dict[str, float]:
        schema: Schema | None = None
        seq = 0
        prev_end: float | None = None  # when the previous rollout finished
        while True:
            t0 = time.monotonic()
            credit = self._next_credit()
            if credit is None:
                break
            trainer, min_version, credit_id = credit
            self._wait_for_version(min_version)
            t_collect = time.monotonic()
            self.waiting_s += t_collect - t0
            batch, stats = self.collector.collect(self.model, self.generator)
            # Timing travels with the batch so the trainers can log the makers' idle fraction: wait = since
            # the previous rollout ended (packing, send queue, credit, weights), busy = collecting this one.
            wait = t_collect - (t0 if prev_end is None else prev_end)
            prev_end = time.monotonic()
            stats = {**stats, "maker_wait_s": wait, "maker_busy_s": prev_end - t_collect}
            if schema is None:
                schema = Schema.of(batch, stats)
                if self.index == 0:
                    self.ctx.store.set("ppo/schema", schema.to_json())
            samples = int(stats.get("env_steps", 1))
            header = Header(self.index, credit_id, seq, self.version, samples).tensor()
            if self.send_error:
                raise PeerLost(f"maker {self.index}: sending experience failed: {self.send_error[0]}")
            self.outbox.put((trainer, header, schema.pack(batch, stats)))
            self.produced += samples
            seq += 1
        # Close every trainer's experience stream so its receive thread ends cleanly.
        bye = Header(transport.GOODBYE, 0, 0, 0, 0).tensor()
        for t in range(self.top.trainers):
            self.outbox.put((t, bye, None))
        self.outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=self.cfg.timeout_s)
        self.ctx.store.set(f"ppo/produced/{self.index}", str(self.produced))
        return {"produced": float(self.produced), "batches": float(seq), "wait_s": self.waiting_s}


# ----------------------------------------------------------------------------------------- trainer


@dataclass
class Received:
    header: Header
    payload: torch.Tensor


class Trainer:
    def __init__(self, ctx: DistContext, top: Topology, cfg: DetachedConfig, workload: Workload,
                 ppo: PPOConfig, trainer_group, weight_group) -> None:
        self.ctx, self.top, self.cfg, self.workload = ctx, top, cfg, workload
        self.weight_group = weight_group
        self.index = ctx.rank
        self.device = torch.device("cpu")
        self.model = workload.build_model(cfg.seed, self.device)
        self.sync_tensors = workload.sync_tensors(self.model)
        self.group = trainer_group
        grad_sync = GradSync([p for p in self.model.parameters() if p.requires_grad], "flat", group=trainer_group)
        self.learner = workload.make_learner(self.model, ppo, grad_sync)
        self.generator = torch.Generator().manual_seed(cfg.seed + 2 + 1000 * self.index)
        self.version = 0
        self.inbox: queue.Queue = queue.Queue()
        self.dead: set[int] = set()  # maker indices (only the main thread changes it)
        self._unreachable: set[int] = set()  # makers the weight thread failed to reach
        self.outstanding = [0] * top.makers  # credits granted and not yet returned as experience
        self.granted_total = 0
        self.watch = Watcher(ctx.store, [top.maker_rank(m) for m in range(top.makers)], cfg.heartbeat_timeout_s)
        self.trainer_watch = Watcher(ctx.store, [r for r in range(top.trainers) if r != self.index],
                                     cfg.heartbeat_timeout_s)
        self._cursor = 0
        self.schema: Schema | None = None
        self.publish_ms = float("nan")
        self._publish_q: queue.Queue = queue.Queue()
        self.bucket = max(1, int(cfg.bucket_mb * 2**20) // max(1, self.sync_tensors[0].element_size()))
        self._pending: deque[int] = deque()  # credit ids in grant order: experience is consumed oldest-first
        self._credit_maker: dict[int, int] = {}
        self._arrived: dict[int, Received] = {}
        self._next_credit_id = 0
        self.threads = [threading.Thread(target=self._recv_loop, args=(m,), name=f"experience-in-{m}", daemon=True)
                        for m in range(top.makers)]
        if self.index == 0:
            self.threads.append(threading.Thread(target=self._publish_loop, name="weights-out", daemon=True))
        for t in self.threads:
            t.start()

    # background paths ----------------------------------------------------------------------------
    def _recv_loop(self, m: int) -> None:
        src = self.top.maker_rank(m)
        header = torch.empty(5, dtype=torch.int64)
        while True:
            try:
                dist.recv(header, src, tag=TAG_HEADER)
                h = Header.from_tensor(header)
                if h.maker == transport.GOODBYE:
                    return
                payload = torch.empty(self._schema().nbytes, dtype=torch.uint8)
                dist.recv(payload, src, tag=TAG_PAYLOAD)
            except Exception:  # maker gone: the heartbeat watcher declares it dead and reroutes
                return
            self.inbox.put(Received(h, payload))

    def _schema(self) -> Schema:
        if self.schema is None:  # written by maker 0 before its first send; wait() has the store's timeout
            self.ctx.store.wait(["ppo/schema"])
            self.schema = Schema.from_json(self.ctx.store.get("ppo/schema").decode())
        return self.schema

    def _publish_loop(self) -> None:
        while True:
            item = self._publish_q.get()
            while not self._publish_q.empty():  # only the newest version matters
                item = self._publish_q.get()
            if item is None:
                for m in self._live():
                    try:
                        transport.send_goodbye(self.top.maker_rank(m), self.weight_group)
                    except Exception:
                        pass
                return
            version, flat = item
            t0 = time.perf_counter()
            failed = transport.send_weights(flat, version, [self.top.maker_rank(m) for m in self._live()],
                                            self.bucket, timedelta(seconds=self.cfg.heartbeat_timeout_s),
                                            self.weight_group)
            self.publish_ms = (time.perf_counter() - t0) * 1000
            # A maker we could not reach gets no more weights; the main thread's heartbeat watcher
            # drops it (and re-issues its credits) once its heartbeat stalls too.
            self._unreachable.update(self.top.maker_index(r) for r in failed)

    # credits -------------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [m for m in range(self.top.makers) if m not in self.dead and m not in self._unreachable]

    def grant(self, count: int) -> None:
        """Hand ``count`` credits to my makers, round-robin, requiring my current version."""
        for _ in range(count):
            mine = self.top.makers_of(self.index, self._live())
            if not mine:
                raise PeerLost(f"trainer {self.index}: every maker is dead "
                               f"(lost: {sorted(self.dead)}); cannot continue")
            m = mine[self._cursor % len(mine)]
            self._cursor += 1
            credit = self._next_credit_id
            try:
                dist.send(torch.tensor([float(self.index), float(self.version), float(credit)], dtype=torch.float64),
                          self.top.maker_rank(m), tag=TAG_CREDIT)
            except Exception:
                self._drop_maker(m)
                self.grant(1)
                continue
            self._next_credit_id += 1
            self._pending.append(credit)
            self._credit_maker[credit] = m
            self.outstanding[m] += 1
            self.granted_total += 1

    def _drop_maker(self, m: int) -> None:
        if m in self.dead:
            return
        self.dead.add(m)
        self.watch.forget(self.top.maker_rank(m))
        lost = [c for c in self._pending if self._credit_maker[c] == m and c not in self._arrived]
        self._pending = deque(c for c in self._pending if c not in lost)
        self.outstanding[m] = 0
        if lost:
            self.grant(len(lost))  # its unfinished rollouts are re-issued to the live makers

    def _check_peers(self) -> None:
        try:
            dead_trainers = self.trainer_watch.dead()
        except Exception as err:
            raise PeerLost(f"trainer {self.index}: lost the rendezvous store hosted by trainer rank 0: {err}") from None
        if dead_trainers:
            raise PeerLost(f"trainer {self.index}: " + ", ".join(_describe(self.ctx, r, "trainer") for r in dead_trainers)
                           + f" stopped responding (no heartbeat for {self.cfg.heartbeat_timeout_s:.0f} s)")
        for rank in self.watch.dead():
            self._drop_maker(self.top.maker_index(rank))

    def next_batch(self) -> Received:
        """The batch of the oldest outstanding credit (later arrivals wait): lag stays <= the bound."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            if self._pending and self._pending[0] in self._arrived:
                credit = self._pending.popleft()
                item = self._arrived.pop(credit)
                self.outstanding[item.header.maker] -= 1
                return item
            try:
                item = self.inbox.get(timeout=0.25)
            except queue.Empty:
                self._check_peers()
                if time.monotonic() > deadline:
                    waiting = [m for m in self._live() if self.outstanding[m]]
                    raise PeerLost(f"trainer {self.index}: no experience within {self.cfg.timeout_s:.0f} s from "
                                   + (", ".join(_describe(self.ctx, self.top.maker_rank(m), "maker") for m in waiting)
                                      or "any maker"))
                continue
            if item.header.maker in self.dead or item.header.credit not in self._credit_maker:
                continue  # arrived after we gave up on its maker: the credit was re-issued already
            self._arrived[item.header.credit] = item

    def publish(self) -> None:
        if self.index == 0:
            self._publish_q.put((self.version, ops.flatten(self.sync_tensors)))  # a fresh tensor: a snapshot

    def stop_publisher(self) -> None:
        if self.index == 0:
            self._publish_q.put(None)
