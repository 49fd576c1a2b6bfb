"""The PPO trainer: grant credits, take experience in credit order, update, publish weights.

:meth:`Trainer.run` holds the whole loop (resume, steps, metrics, checkpoints, stop, drain, the end
of every stream). Background threads: one experience receiver per linked maker and, on trainer 0,
the weight publisher. Only the main thread changes credit bookkeeping; no lock is held across a
communication call.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from hpcrl import checkpoint, rundir
from hpcrl.comm import IDLE_TIMEOUT, DistContext, StopRequest, barrier, hosts, reduce_metrics
from hpcrl.metrics import RunLogger

from .channels import ChannelError, Credit, CreditChannel, ExperienceChannel, Header, Schema, WeightChannel
from .config import DetachedConfig
from .events import BatchReceived, Events, RowLogged, WeightsPublished
from .groups import Groups, staging_note
from .liveness import FINISHED_KEY, PeerLost, Watcher, describe, done_key, dropped_key, liveness_store, produced_key
from .strategy import Strategy
from .topology import Topology
from .workload import PPOConfig, Workload

__all__ = ["Trainer"]

MIN_RECENT_EPISODES = 20
_LOOK_S = 0.5  # how often the trainer reads the peers' heartbeats while waiting for experience  # episode_return_recent: mean over the latest steps that finished this many


# DetachedConfig fields a resume may not change; with the number of trainers (the checkpoint's world)
# they are the run's identity. Everything else (steps, lag, makers, devices, timeouts, checkpoint
# cadence) may change between the jobs of one run dir.
# The option groups (--env.*, --lm.*, --ppo.*) are part of it: they change the model or the update.
IDENTITY_FIELDS = ("seed", "workload", "env", "lm", "hf", "ppo", "plugin_args")


def run_identity(cfg: DetachedConfig, trainers: int) -> dict:
    def plain(value):
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value

    return {"trainers": trainers, **{name: plain(getattr(cfg, name)) for name in IDENTITY_FIELDS}}


def _say(logger: RunLogger, what: str, *args) -> None:
    """RunLogger's early-stop / summary line; printed here where that logger has no such method."""
    method = getattr(logger, what, None)
    if method is not None:
        method(*args)
    elif what == "early_stop":
        print(f"hpcrl.ppo: stopped early at update {args[1]}: {args[0]}", flush=True)
    else:
        results, paths = args
        print("hpcrl.ppo: done: " + ", ".join([f"{k}={v}" for k, v in results.items()]
                                             + [f"{k} {p}" for k, p in paths.items() if p]), flush=True)


@dataclass
class Received:
    header: Header
    payload: torch.Tensor


class Trainer:
    def __init__(self, ctx: DistContext, top: Topology, cfg: DetachedConfig, workload: Workload, ppo: PPOConfig,
                 groups: Groups, stop: StopRequest, events: Events) -> None:
        self.ctx, self.top, self.cfg, self.workload, self.groups = ctx, top, cfg, workload, groups
        self.stop, self.events = stop, events
        self.index = ctx.rank
        self.device = ctx.device
        # fsdp: built in host memory; fully_shard moves one unit at a time to the device, so no trainer
        # holds the whole model there
        self.model = workload.build_model(cfg.seed, torch.device("cpu") if cfg.strategy == "fsdp" else self.device)
        self.strategy = Strategy(cfg.strategy, self.model, workload, groups.trainer_device, self.device,
                                 keep=self.index == 0, offload=cfg.offload, dtype=cfg.trainer_dtype)
        self.sync_tensors = workload.sync_tensors(self.model)  # sharded under fsdp: snapshot() gathers them
        self.learner = workload.make_learner(self.model, ppo, self.strategy.grad_sync)
        self.generator = torch.Generator().manual_seed(cfg.seed + 2 + 1000 * self.index)
        self.version = 0
        self.credits = CreditChannel(groups.exchange, top.trainers)
        self.experience = ExperienceChannel(groups.exchange, schema=self._schema,
                                            max_version=lambda: self.version + 1, maker_index=top.maker_index)
        self.dead: set[int] = set()  # maker indices (only the main thread changes it)
        self._unreachable: set[int] = set()  # makers the publisher failed to reach
        self._failed: dict[int, BaseException] = {}  # maker -> what its receive thread hit
        self.outstanding = [0] * top.makers  # credits granted and not yet returned as experience
        self._used = [0] * top.makers  # samples per maker consumed, dropped as stale or drained
        live = liveness_store(ctx.store, cfg.heartbeat_timeout_s)
        self.watch = Watcher(live, [top.maker_rank(m) for m in range(top.makers)], cfg.heartbeat_timeout_s)
        self.trainer_watch = Watcher(live, [r for r in range(top.trainers) if r != self.index],
                                     cfg.heartbeat_timeout_s)
        self._inbox: queue.Queue = queue.Queue()
        self._schemas: dict[int, Schema] = {}
        self._cursor = 0
        self._pending: deque[int] = deque()  # credit ids in grant order: experience is consumed oldest-first
        self._credit_maker: dict[int, int] = {}
        self._sending: dict[int, list] = {}  # maker -> credit sends posted and not yet completed (work, tensor)
        self._arrived: dict[int, Received] = {}
        self._next_credit_id = 0
        self._draining = False
        self._next_look = 0.0
        self.publish_ms = float("nan")
        # A one-slot mailbox, not a queue: a busy publisher must not pile up model copies (GPU memory).
        self._mailbox: list = []  # [] empty, [(version, flat)] a snapshot, [None] end of stream
        self._latest: tuple[int, torch.Tensor] | None = None  # trainer 0: the newest snapshot posted
        self._mail = threading.Condition()
        self._publish_error: BaseException | None = None
        # One receiver per maker, linked or not: when makers die the modulo rule re-links the live ones.
        self._receivers = {m: threading.Thread(target=self._receive_loop, args=(m,), name=f"experience-in-{m}",
                                               daemon=True) for m in range(top.makers)}
        self.threads = list(self._receivers.values())
        if self.index == 0:
            dtype = self.sync_tensors[0].dtype
            self.weights = WeightChannel(groups.weights, groups.exchange, ctx.store,
                                         sum(t.numel() for t in self.sync_tensors), dtype, cfg.bucket_numel(dtype),
                                         cfg.timeout_s, alive=lambda: not self.dead)
            self.threads.append(threading.Thread(target=self._publish_loop, name="weights-out", daemon=True))
        for t in self.threads:
            t.start()

    # the whole loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg, top, main = self.cfg, self.top, self.index == 0
        run_dir = Path(cfg.run_dir)
        env_steps = 0.0
        found = self._restore() if cfg.resume else None
        if found is not None:
            learner_state, mine = found.learner, found.rank_state
            self.strategy.load_full_state(self.learner, learner_state["model"], learner_state["learner"])
            self.version = int(learner_state["version"])
            env_steps = float(learner_state["env_steps"])
            self.generator.set_state(mine["generator"])
            # credits number the batches, and batch b is a fixed slice of a dataset workload's data
            # (Collector.assign): the first batch not trained on is the one to collect next
            self._next_credit_id = int(mine.get("next_credit", 0))
            if self.version > 0:
                self._publish()  # makers start from the initial weights: bring them to the resumed version
        elif main and (removed := checkpoint.clear(run_dir)):  # a fresh start: the run dir is this run's now
            print(f"hpcrl.ppo: fresh start in {run_dir}: removed {len(removed)} checkpoint(s) of the run that used "
                  f"it before (newest {removed[0].name}); pass --resume to continue a run instead", flush=True)
        if main:
            self._write_config(run_dir)
            rundir.clear_outcome(run_dir)  # until this run says how it ended (the batch scripts read it)
        resumed_env_steps = env_steps
        logger = RunLogger(run_dir, main, cfg.total_steps, resume_env_steps=int(env_steps), progress_key="updates")
        self._grant((cfg.lag + 1) * cfg.batches_per_step)
        dropped_stale = 0.0
        recent: deque[tuple[float, float]] = deque()  # (return sum, episodes) of the latest steps
        row: dict[str, float] = {}
        reached = False  # --target-return met (the same verdict on every trainer: the row is reduced)
        best = float("nan")  # highest episode_return_recent so far, for the final line
        last = time.perf_counter()
        for _ in range(self.version, cfg.total_steps):
            batches, lags, stats_sum = [], [], {}
            wait_t0 = time.perf_counter()
            while len(batches) < cfg.batches_per_step:
                t0 = time.perf_counter()
                item = self._next_batch()
                self._used[item.header.maker] += item.header.samples
                lag = self.version - item.header.version
                data, stats = self._schema(self.top.maker_rank(item.header.maker)).unpack(item.payload, self.device)
                stale = lag > cfg.stale_cap
                self.events(BatchReceived(time.time(), self.index, item.header.maker, item.header.version, lag,
                                          time.perf_counter() - t0, item.header.samples, stale))
                if stale:
                    dropped_stale += item.header.samples
                    self._grant(1)
                    for k in ("maker_wait_s", "maker_busy_s"):  # the makers' time was spent all the same
                        stats_sum[k] = stats_sum.get(k, 0.0) + stats.get(k, 0.0)
                    continue
                batches.append(data)
                lags.append(lag)
                for k, v in stats.items():
                    stats_sum[k] = stats_sum.get(k, 0.0) + v
            wait_s = time.perf_counter() - wait_t0
            try:
                learn = self.learner.update(batches, self.generator)
            except RuntimeError as err:  # if a collective of the trainer group failed: name who is missing
                self._name_lost_trainer()
                raise PeerLost(f"trainer {self.index}: the PPO update failed with every trainer alive: {err}") from err
            self.version += 1
            self._publish()
            self._grant(cfg.batches_per_step)

            now = time.perf_counter()
            step_s = max(now - last, 1e-9)
            last = now
            reduced = reduce_metrics(
                {"samples": stats_sum.get("env_steps", 0.0), "return_sum": stats_sum.get("episode_return_sum", 0.0),
                 "episodes": stats_sum.get("episodes", 0.0), "lag_sum": float(sum(lags)), "batches": float(len(lags)),
                 "lag_max": float(max(lags)), "lag_min": float(min(lags)), "idle_frac": wait_s / step_s,
                 "dropped_stale": dropped_stale, "maker_wait_s": stats_sum.get("maker_wait_s", 0.0),
                 "maker_busy_s": stats_sum.get("maker_busy_s", 0.0), **{f"learn/{k}": v for k, v in learn.items()}},
                self.groups.trainer_host,
                sums=["samples", "return_sum", "episodes", "lag_sum", "batches", "dropped_stale", "maker_wait_s",
                      "maker_busy_s"],
                maxes=["lag_max"], mins=["lag_min"])
            env_steps += reduced["samples"]
            recent.append((reduced["return_sum"], reduced["episodes"]))
            while len(recent) > 1 and sum(n for _, n in recent) - recent[0][1] >= MIN_RECENT_EPISODES:
                recent.popleft()
            recent_episodes = sum(n for _, n in recent)
            row = {"env_steps": int(env_steps), "updates": self.version, "policy_version": self.version,
                   "episode_return": (reduced["return_sum"] / reduced["episodes"] if reduced["episodes"]
                                      else float("nan")),
                   "episode_return_recent": (sum(r for r, _ in recent) / recent_episodes
                                             if recent_episodes >= MIN_RECENT_EPISODES else float("nan")),
                   "lag_mean": reduced["lag_sum"] / reduced["batches"], "lag_max": reduced["lag_max"],
                   "lag_min": reduced["lag_min"], "dropped_stale": reduced["dropped_stale"],
                   "weight_sync_ms": self.publish_ms, "samples_per_s": reduced["samples"] / step_s,
                   "trainer_idle_frac": reduced["idle_frac"],
                   # of the makers' time behind this step's batches, the share not spent collecting
                   "maker_idle_frac": reduced["maker_wait_s"] / max(reduced["maker_wait_s"] + reduced["maker_busy_s"],
                                                                    1e-9),
                   **{k.removeprefix("learn/"): v for k, v in reduced.items() if k.startswith("learn/")}}
            row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
            logger.log(row)
            self.events(RowLogged(time.time(), self.index, dict(row)))
            if cfg.checkpoint_every and self.version % cfg.checkpoint_every == 0:
                self._save(env_steps)
            if row["episode_return_recent"] == row["episode_return_recent"]:  # not NaN
                best = row["episode_return_recent"] if best != best else max(best, row["episode_return_recent"])
            # Every trainer sees the same reduced row, so they all stop at the same step.
            if cfg.target_return is not None and row["episode_return_recent"] >= cfg.target_return:
                reached = True
                break
            if self.version < cfg.total_steps and self.stop.agreed(self.groups.trainer_host):
                row["preempted"] = 1.0
                if main:
                    print(f"hpcrl.ppo: stop requested ({self.stop.reason}); checkpoint at v{self.version}, "
                          "resume with --resume", flush=True)
                break

        consumed = env_steps - resumed_env_steps  # this job's makers produced only this job's samples
        saved = self._save(env_steps)
        drained = self._drain()
        used = {f"used/{m}": float(n) for m, n in enumerate(self._used)}
        totals = reduce_metrics({"dropped_shutdown": drained, "dropped_stale": dropped_stale, **used},
                                self.groups.trainer_host, sums=["dropped_shutdown", "dropped_stale", *used])
        if main:
            self._post(None)  # the publisher ends the weight stream after the last version
            self.ctx.store.set(FINISHED_KEY, "1")  # a maker that missed the end (frozen) learns it here
            for m in range(top.makers):
                if m not in self.dead:
                    try:
                        self._sending.setdefault(m, []).append(self.credits.stop(top.maker_rank(m)))
                    except Exception:  # gone in the meantime: nothing to stop
                        pass
            produced = lost = 0.0
            for m in range(top.makers):
                if m not in self.dead:  # a live maker's count is final once it reports done after STOP
                    try:
                        self.ctx.store.wait([done_key(m)], timedelta(seconds=cfg.timeout_s))
                    except RuntimeError:
                        raise PeerLost(f"trainer 0: {describe(self.ctx, top.maker_rank(m), 'maker')} did not finish "
                                       f"within {cfg.timeout_s:.0f} s of the STOP credit") from None
                made = float(self.ctx.store.add(produced_key(m), 0))
                if not 0 <= made < 2**62:  # an add counter cannot be signed: bound what it may say
                    raise PeerLost(f"trainer 0: store counter {produced_key(m)!r} reads {made:.0f}, not a sample count")
                produced += made
                if m in self.dead:  # what a lost maker made and no trainer used died with it (or in flight)
                    lost += made - totals[f"used/{m}"]
            row.update(samples_produced=produced, samples_consumed=consumed, dropped_shutdown=totals["dropped_shutdown"],
                       dropped_stale=totals["dropped_stale"], lost_in_flight=lost, makers_lost=float(len(self.dead)))
            logger.log(row)
            self._report(logger, row, reached, best, saved)
            if not row.get("preempted"):  # last: every sample is accounted for and the checkpoint written
                rundir.record_outcome(run_dir, "finished", policy_version=self.version, makers_lost=len(self.dead))
        logger.close()
        deadline = time.monotonic() + cfg.heartbeat_timeout_s + 5.0  # one deadline, not one per maker
        for m, thread in self._receivers.items():  # live makers close their streams after the STOP credit;
            if m not in self.dead:                # a lost maker's receiver stays blocked: a daemon, not waited for
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return row

    # start-up, checkpoints, shutdown --------------------------------------------------------------
    def _restore(self) -> checkpoint.Restored | None:
        """The newest checkpoint every trainer can load (collective over the trainers; an unusable newer
        one is reported and skipped); None with ``--resume-missing fresh`` and nothing to resume."""
        cfg, top = self.cfg, self.top
        found = checkpoint.restore(cfg.run_dir, self.index, top.trainers, self.strategy.restore_device,
                                   identity=run_identity(cfg, top.trainers),
                                   agree=checkpoint.store_agree(self.ctx, ranks=list(range(top.trainers)),
                                                                name="ppo/ckpt-restore"))
        if found is None:
            checkpoint.fresh_or_refuse(cfg.run_dir, cfg.resume_missing, self.index == 0, "hpcrl.ppo")
        return found

    def _write_config(self, run_dir: Path) -> None:
        cfg, top = self.cfg, self.top
        names = hosts(self.ctx)
        rundir.write_text(run_dir / "config.json", json.dumps(
            {**dataclasses.asdict(cfg), "world_size": self.ctx.world_size, "launcher": self.ctx.source,
             "hosts": {"trainers": names[: top.trainers], "makers": names[top.trainers :]},
             "planes": {"trainers": self.groups.trainer_device.backend, "weights": self.groups.weights.backend}},
            indent=2, default=str))
        print(f"hpcrl.ppo: {top.makers} maker(s) : {top.trainers} trainer(s) via {self.ctx.source}; workload "
              f"{cfg.workload}; trainers on {self.device} ({self.groups.trainer_device.backend}), "
              f"{staging_note(self.groups, self.device)}; lag {cfg.lag} (cap {cfg.stale_cap}); "
              f"{cfg.batches_per_step} batch(es) per trainer per step; {cfg.total_steps} steps"
              + (f"; resuming at v{self.version}" if self.version else ""), flush=True)

    def _report(self, logger: RunLogger, row: dict, reached: bool, best: float, saved: Path | None) -> None:
        """The run's last lines (trainer 0): that --target-return was reached (update, return, time), or
        that the budget ended first, then the summary (final return, checkpoint, metrics)."""
        cfg = self.cfg
        recent = row.get("episode_return_recent", float("nan"))
        results: dict = {"episode_return_recent": recent, "updates": self.version, "env_steps": row.get("env_steps")}
        if reached:
            _say(logger, "early_stop", f"episode_return_recent {recent:.1f} >= --target-return {cfg.target_return:g}",
                 self.version)
        elif cfg.target_return is not None and not row.get("preempted"):
            shown = "-" if best != best else f"{best:.1f}"
            results["target_return"] = (f"{cfg.target_return:g} not reached in {cfg.total_steps} updates (best "
                                        f"episode_return_recent {shown}; raise --total-steps)")
        _say(logger, "finish", results, {"checkpoint": saved})

    def _save(self, env_steps: float) -> Path | None:
        trainers = list(range(self.top.trainers))

        def trainer_barrier(name: str) -> None:
            barrier(self.ctx, f"ppo/{name}", ranks=trainers)

        model_state = self.strategy.full_state(self.model.state_dict())  # gathered under fsdp (every trainer)
        learner_state = self.strategy.full_state(self.learner.state_dict())
        learner = ({"model": model_state, "learner": learner_state, "version": self.version, "env_steps": env_steps}
                   if self.index == 0 else None)
        untrained = self._pending[0] if self._pending else self._next_credit_id  # outstanding: collected again
        saved = checkpoint.save(self.cfg.run_dir, self.version, self.index, self.top.trainers, learner,
                                {"generator": self.generator.get_state(), "next_credit": untrained}, trainer_barrier,
                                identity=run_identity(self.cfg, self.top.trainers))
        export = getattr(self.workload, "save_artifacts", None)
        if self.index == 0 and export is not None:  # e.g. the HF actor with save_pretrained
            export(model_state)
        return saved

    def _drain(self) -> float:
        """Collect every outstanding rollout (or give up on dead makers); count them as dropped at shutdown."""
        self._draining = True  # lost makers' credits are not re-issued any more
        dropped = 0.0
        try:
            while self._pending:  # each wait is bounded by --timeout-s; makers that die are dropped
                item = self._next_batch()
                self._used[item.header.maker] += item.header.samples
                dropped += item.header.samples
        except PeerLost as err:
            print(f"hpcrl.ppo: trainer {self.index}: gave up collecting the last rollouts: {err}", flush=True)
        return dropped

    # weights ------------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Every trainer, after each update (fsdp gathers the shards): trainer 0 posts the new version."""
        flat = self.strategy.snapshot(self.sync_tensors, self.cfg.bucket_numel(self.sync_tensors[0].dtype))
        if self._publish_error is not None:  # after the collective: the other trainers are not left in it
            raise PeerLost(f"trainer {self.index}: publishing weights to the makers failed: {self._publish_error}")
        if self.index == 0:  # a fresh flat tensor: a snapshot the next update cannot change
            self._latest = (self.version, flat)
            self._post(self._latest)

    def _republish(self) -> None:
        """Trainer 0 posts its newest snapshot again (one trainer alone: no collective)."""
        if self._publish_error is not None:
            raise PeerLost(f"trainer {self.index}: publishing weights to the makers failed: {self._publish_error}")
        if self.index == 0 and self._latest is not None:  # None: the makers hold v0 from their own build
            self._post(self._latest)

    def _post(self, item) -> None:
        with self._mail:
            if self._mailbox != [None]:  # only the newest version matters; the end marker stays
                self._mailbox[:] = [item]
            self._mail.notify()

    def _publish_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._mail:
                self._mail.wait_for(lambda: bool(self._mailbox))
                item = self._mailbox.pop()
            live = [self.top.maker_rank(m) for m in self._live()]
            if item is None:
                self.weights.end(live)
                return
            version, flat = item
            t0 = time.perf_counter()
            before = self.weights.transport
            try:
                failed = self.weights.publish(flat, version, live)
            except Exception as err:  # the main thread raises it at its next publish
                self._publish_error = err
                return
            seconds = time.perf_counter() - t0
            self.publish_ms = seconds * 1000
            if self.weights.transport != before:
                print(f"hpcrl.ppo: the weight broadcast to the makers could not complete at v{version} (a maker is "
                      f"lost or hangs); weights go {self.weights.transport} to the {len(live)} live maker(s) from now on",
                      flush=True)
            self.events(WeightsPublished(time.time(), version, seconds, self.weights.nbytes, len(live),
                                         self.weights.transport))
            # A maker we could not reach gets no more weights; the main thread's heartbeat watcher
            # drops it (and re-issues its credits) once its heartbeat stalls too.
            if failed:  # rebinding, not update(): the main thread may be iterating over it
                self._unreachable = self._unreachable | {self.top.maker_index(r) for r in failed}

    # experience and credits ---------------------------------------------------------------------
    def _schema(self, maker_rank: int) -> Schema:
        """The layout a maker announced before its first batch (its receive thread is the first to ask)."""
        if maker_rank not in self._schemas:
            key = f"ppo/schema/{maker_rank}"
            self.ctx.store.wait([key], IDLE_TIMEOUT)  # a maker may take long to its first rollout
            self._schemas[maker_rank] = Schema.from_json(self.ctx.store.get(key).decode(),
                                                         source=describe(self.ctx, maker_rank, "maker"))
        return self._schemas[maker_rank]

    def _receive_loop(self, m: int) -> None:
        rank = self.top.maker_rank(m)
        while True:
            try:
                got = self.experience.receive(rank)
            except Exception as err:  # garbage or gone: the main thread drops it (and names why, if garbage)
                self._failed[m] = err
                return
            if got is None:
                return
            self._inbox.put(Received(*got))

    def _live(self) -> list[int]:
        return [m for m in range(self.top.makers) if m not in self.dead and m not in self._unreachable]

    def _grant(self, count: int) -> None:
        """Hand ``count`` credits to my makers, round-robin, requiring my current version."""
        for _ in range(count):
            mine = self.top.makers_of(self.index, self._live())
            if not mine:
                raise PeerLost(f"trainer {self.index}: every maker is dead (lost: {sorted(self.dead)}); cannot continue")
            m = mine[self._cursor % len(mine)]
            self._cursor += 1
            credit = self._next_credit_id
            try:
                sent = self.credits.grant(self.top.maker_rank(m), Credit(self.index, self.version, credit))
            except Exception:
                self._drop_maker(m)
                self._grant(1)
                continue
            self._sending.setdefault(m, []).append(sent)
            self._next_credit_id += 1
            self._pending.append(credit)
            self._credit_maker[credit] = m
            self.outstanding[m] += 1

    def _drop_maker(self, m: int) -> None:
        if m in self.dead:
            return
        self.dead.add(m)
        self.watch.forget(self.top.maker_rank(m))
        self.ctx.store.set(dropped_key(m), "1")  # should it wake up (a freeze), it learns it and leaves
        if isinstance(self._failed.get(m), ChannelError):
            print(f"hpcrl.ppo: trainer {self.index}: dropping {describe(self.ctx, self.top.maker_rank(m), 'maker')}: "
                  f"{self._failed[m]}", flush=True)
        lost = [c for c in self._pending if self._credit_maker[c] == m and c not in self._arrived]
        self._pending = deque(c for c in self._pending if c not in lost)
        self.outstanding[m] = 0
        if self._draining:
            return
        # Makers behind the lost one in the broadcast tree may miss the current version: publishing it
        # again moves the weight channel to point-to-point copies for the live makers.
        self._republish()
        if lost:
            self._grant(len(lost))  # its unfinished rollouts are re-issued to the live makers

    def _check_peers(self) -> None:
        try:
            dead_trainers = self.trainer_watch.dead()
        except Exception as err:
            raise PeerLost(f"trainer {self.index}: lost the rendezvous store hosted by trainer rank 0: {err}") from None
        if dead_trainers:
            raise PeerLost(f"trainer {self.index}: " + ", ".join(describe(self.ctx, r, "trainer") for r in dead_trainers)
                           + f" stopped responding (no heartbeat for {self.cfg.heartbeat_timeout_s:.0f} s)")
        for rank in self.watch.dead():
            self._drop_maker(self.top.maker_index(rank))
        for m, sends in list(self._sending.items()):  # forget delivered credits; a failed send loses its maker
            pending = [(work, msg) for work, msg in sends if not work.is_completed()]
            self._sending[m] = pending
            if m in self.dead:
                continue
            try:
                for work, _ in sends:
                    if work.is_completed():
                        work.wait()
            except Exception:
                self._drop_maker(m)
        # a maker whose stream broke (garbage, or gone before its heartbeat stalls) or that the publisher
        # cannot reach is lost too: its credits are re-issued to the live ones
        for m in [*self._failed, *self._unreachable]:
            if isinstance(self._failed.get(m), ChannelError) or m in self._unreachable:
                self._drop_maker(m)

    def _name_lost_trainer(self) -> None:
        """After a failed trainer collective: wait (up to the heartbeat timeout) until the lost trainer's
        heartbeat is stale, so the error can name it rather than just report the collective."""
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            self._check_peers()  # raises PeerLost naming a dead trainer
            time.sleep(0.25)

    def _next_batch(self) -> Received:
        """The batch of the oldest outstanding credit (later arrivals wait): lag stays <= the bound."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            if time.monotonic() >= self._next_look:  # also while experience flows: a frozen maker is dropped
                self._next_look = time.monotonic() + _LOOK_S
                self._check_peers()
            if self._pending and self._pending[0] in self._arrived:
                credit = self._pending.popleft()
                item = self._arrived.pop(credit)
                self.outstanding[item.header.maker] -= 1
                return item
            try:
                item = self._inbox.get(timeout=0.25)
            except queue.Empty:
                self._check_peers()
                if time.monotonic() > deadline:
                    waiting = [m for m in self._live() if self.outstanding[m]]
                    raise PeerLost(f"trainer {self.index}: no experience within {self.cfg.timeout_s:.0f} s from "
                                   + (", ".join(describe(self.ctx, self.top.maker_rank(m), "maker") for m in waiting)
                                      or "any maker"))
                continue
            if item.header.maker in self.dead or self._credit_maker.get(item.header.credit) != item.header.maker:
                continue  # arrived after we gave up on its maker (credit re-issued), or not a credit we gave it
            self._arrived[item.header.credit] = item
