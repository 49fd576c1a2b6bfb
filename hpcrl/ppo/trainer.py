"""The PPO trainer: take experience in credit order, update, publish weights, grant credits, log.

:meth:`Trainer.run` is the loop; three objects do the rest: the :class:`~hpcrl.ppo.ledger.MakerLedger`
(credits, experience in credit order, the makers' liveness, drop, drain), trainer 0's
:class:`~hpcrl.ppo.publisher.Publisher` (the weights' mailbox and thread) and the :class:`Replica`
(the model, its strategy and learner). The ledger returns the makers it loses; the loop follows them
up (:meth:`Trainer._follow_losses`): their credits go to the live makers, and the publisher sends to
the live makers only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from hpcrl.run import checkpoint, rundir
from hpcrl.comm import DistContext, StopRequest, barrier, hosts, reduce_metrics
from hpcrl.comm.heartbeat import PeerLost, Watcher, describe, liveness_store
from hpcrl.run.metrics import RunLogger

from .channels import CreditChannel, ExperienceChannel, SchemaChannel, StatusChannel, WeightChannel
from .config import DetachedConfig
from .credits import Received
from .events import BatchReceived, Events, RowLogged
from .ledger import Lost, MakerLedger, MakerWires
from .publisher import Publisher
from .role_planes import RolePlanes, staging_note
from .rows import MAKER_TIME, STEP_SUMS, Tally, add_stats, closing_row, step_metrics
from .replica import Replica
from . import accounts, trainer_checkpoint
from .trainer_checkpoint import TrainerCheckpoints
from .topology import Topology
from .wire import RESTORE_AGREE, barrier_name
from .workload import PPOConfig, Workload

__all__ = ["Trainer", "run_identity"]


def run_identity(cfg: DetachedConfig, trainers: int | None = None) -> dict:
    """What a resume may not change (:func:`hpcrl.ppo.trainer_checkpoint.run_identity`); the trainer
    count is not part of it (``trainers`` is accepted and ignored, for older callers)."""
    return trainer_checkpoint.run_identity(cfg)


class Trainer:
    def __init__(self, ctx: DistContext, top: Topology, cfg: DetachedConfig, workload: Workload, ppo: PPOConfig,
                 planes: RolePlanes, stop: StopRequest, events: Events) -> None:
        self.ctx, self.top, self.cfg, self.workload, self.planes = ctx, top, cfg, workload, planes
        self.stop, self.events = stop, events
        self.replica = Replica.build(cfg, workload, ppo, planes.trainer_device, ctx.device, ctx.rank)
        self.version = 0
        self.carried = accounts.carried(None, 0)  # the accounts of the jobs before this one (_start)
        self.schemas = SchemaChannel(ctx.store, name=lambda rank: describe(ctx, rank, "maker"))
        self.makers = MakerLedger(ctx.rank, top, self._wires(), cfg.timeout_s, cfg.heartbeat_timeout_s,
                                  name=lambda rank, role: describe(ctx, rank, role))
        self.publisher = self._publisher() if ctx.rank == 0 else None
        trainers = list(range(top.trainers))
        self.checkpoints = TrainerCheckpoints(
            cfg, ctx.rank, top.trainers, self.replica.model, self.replica.learner, ctx.device,
            lambda name: barrier(ctx, barrier_name(name), ranks=trainers),
            checkpoint.store_agree(ctx, ranks=trainers, name=RESTORE_AGREE), planes.checkpoint.group)
        if ctx.rank == 0 and workload.capabilities().saves_artifacts:  # e.g. the HF actor, streamed from the shards
            from .export import save_artifacts

            self.checkpoints.after_commit = lambda path: save_artifacts(workload, path)

    @property
    def index(self) -> int:
        return self.ctx.rank

    @property
    def dead(self) -> set[int]:
        """The maker indices this trainer lost."""
        return self.makers.dead

    def _wires(self) -> MakerWires:
        ctx, top, cfg = self.ctx, self.top, self.cfg
        experience = ExperienceChannel(self.planes.exchange, schema=self.schemas.get,
                                       max_version=lambda: self.version + 1, maker_index=top.maker_index)
        live = liveness_store(ctx.store, cfg.heartbeat_timeout_s)
        makers = Watcher(live, [top.maker_rank(m) for m in range(top.makers)], cfg.heartbeat_timeout_s)
        trainers = Watcher(live, [r for r in range(top.trainers) if r != ctx.rank], cfg.heartbeat_timeout_s)
        return MakerWires(CreditChannel(self.planes.exchange, top.trainers), experience, StatusChannel(ctx.store),
                          makers, trainers)

    def _publisher(self) -> Publisher:
        tensors, cfg = self.replica.tensors, self.cfg
        dtype = tensors[0].dtype
        weights = WeightChannel(self.planes.weights, self.planes.exchange, self.ctx.store,
                                sum(t.numel() for t in tensors), dtype, cfg.bucket_numel(dtype), cfg.timeout_s)
        return Publisher(weights, [self.top.maker_rank(m) for m in range(self.top.makers)], self.ctx.device,
                         self.events)

    # the whole loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        self.makers.start()
        if self.publisher is not None:
            self.publisher.start()
        env_steps = self._start()
        logger = RunLogger(Path(cfg.run_dir), self.index == 0, cfg.total_steps, resume_env_steps=int(env_steps),
                           progress_key="updates")
        tally = Tally(env_steps, resumed_env_steps=env_steps)
        self._grant((cfg.lag + 1) * cfg.batches_per_step)
        # a job resumed at its budget runs no step: its closing row still says where the run is
        row: dict = {"env_steps": float(env_steps), "updates": self.version, "policy_version": self.version}
        reached = False  # --target-return met (the same verdict on every trainer: the row is reduced)
        last = time.perf_counter()
        for _ in range(self.version, cfg.total_steps):
            wait_t0 = time.perf_counter()
            batches, lags, stats = self._take(tally)
            wait_s = time.perf_counter() - wait_t0
            learn = self._update(batches)
            self._publish()
            self._grant(cfg.batches_per_step)
            now = time.perf_counter()
            step_s, last = max(now - last, 1e-9), now
            row = self._log(logger, tally, step_metrics(stats, lags, wait_s, step_s, tally.dropped_stale, learn),
                            step_s)
            if cfg.checkpoint_every and self.version % cfg.checkpoint_every == 0:
                self._save(tally.env_steps)
            # Every trainer sees the same reduced row, so they all stop at the same step.
            reached = cfg.target_return is not None and row["episode_return_recent"] >= cfg.target_return
            if reached or self._stop_requested(row):
                break
        return self._finish(logger, tally, row, reached)

    def _take(self, tally: Tally) -> tuple[list[dict[str, torch.Tensor]], list[int], dict[str, float]]:
        """This step's batches in credit order, their lags and summed rollout stats; a stale batch (lag
        over the cap) is dropped and its credit granted again."""
        batches, lags, stats_sum = [], [], {}
        while len(batches) < self.cfg.batches_per_step:
            t0 = time.perf_counter()
            item = self._next_batch()
            h = item.header
            lag = self.version - h.version
            data, stats = self.schemas.get(self.top.maker_rank(h.maker)).unpack(item.payload, self.ctx.device)
            stale = lag > self.cfg.stale_cap
            self.events(BatchReceived(time.time(), self.index, h.maker, h.version, lag, time.perf_counter() - t0,
                                      h.samples, stale))
            if stale:
                tally.dropped_stale += h.samples
                self._grant(1)
                add_stats(stats_sum, stats, MAKER_TIME)
                continue
            batches.append(data)
            lags.append(lag)
            add_stats(stats_sum, stats)
        return batches, lags, stats_sum

    def _update(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        try:
            learn = self.replica.learner.update(batches, self.replica.generator)
        except RuntimeError as err:  # if a collective of the trainer plane failed: name who is missing
            self._name_lost_trainer()
            raise PeerLost(f"trainer {self.index}: the PPO update failed with every trainer alive: {err}") from err
        self.version += 1
        return learn

    def _publish(self) -> None:
        """Every trainer, after each update (fsdp gathers the shards): trainer 0 posts the new version."""
        flat = self.replica.snapshot(self.cfg.bucket_numel(self.replica.tensors[0].dtype))
        if self.publisher is not None:  # a publish error raised after the collective: no trainer is left in it
            self.publisher.post(self.version, flat)

    # the makers: experience in, credits out, losses followed up ---------------------------------
    def _next_batch(self) -> Received:
        """The ledger's next batch (see :mod:`hpcrl.ppo.ledger` for the order), each wait bounded by the
        timeout; the makers it loses meanwhile are followed up between its polls."""
        deadline = time.monotonic() + self.makers.timeout_s
        while True:
            polled = self.makers.poll(deadline)
            self._follow_losses(polled.lost)
            if polled.batch is not None:
                return polled.batch

    def _grant(self, count: int) -> None:
        """``count`` credits requiring my current version (to makers the publisher can still reach)."""
        self._follow_losses()
        self._follow_losses(self.makers.grant(count, self.version))

    def _follow_losses(self, lost: Lost = Lost()) -> None:
        """Makers the publisher could not reach are lost too; the lost makers' credits go to the live
        makers (none during the drain). A lost maker changes who the publisher sends to, and (until the
        drain) trainer 0 posts its newest version again: makers behind the lost one in the broadcast tree
        may have missed it, and the channel now copies it to the live makers."""
        if self.publisher is not None:
            for rank in self.publisher.unreachable():
                lost += self.makers.drop(self.top.maker_index(rank))
        if lost.credits:
            lost += self.makers.reissue(lost.credits)
        if lost.makers and self.publisher is not None:  # only trainer 0 publishes
            self.publisher.set_live([self.top.maker_rank(m) for m in self.makers.live()])
            if not self.makers.draining:
                self.publisher.republish()

    def _drain(self) -> float:
        """Collect every outstanding rollout (each wait bounded by the timeout; the credits of makers lost
        meanwhile are not re-issued): the samples dropped at shutdown."""
        self.makers.draining = True
        dropped, deadline = 0.0, time.monotonic() + self.makers.timeout_s
        try:
            while self.makers.pending:  # a drop may empty it while we wait
                polled = self.makers.poll(deadline)
                self._follow_losses(polled.lost)
                if polled.batch is not None:
                    dropped += polled.batch.header.samples
                    deadline = time.monotonic() + self.makers.timeout_s
        except PeerLost as err:
            print(f"hpcrl.ppo: trainer {self.index}: gave up collecting the last rollouts: {err}", flush=True)
        return dropped

    def _log(self, logger: RunLogger, tally: Tally, metrics: dict[str, float], step_s: float) -> dict:
        maxes = ["lag_max", *(k for k in ("learn/is_weight_max",) if k in metrics)]
        reduced = reduce_metrics(metrics, self.planes.trainer_host, sums=STEP_SUMS, maxes=maxes, mins=["lag_min"])
        publish_ms = self.publisher.publish_ms if self.publisher is not None else float("nan")
        row = tally.row(reduced, self.version, publish_ms, step_s)
        evals = {k: row.pop(k) for k in [k for k in row if k.startswith("eval_")]}
        logger.log(row)
        if evals:  # a workload's held-out evaluation: its own row, as FastSAC's eval rows
            logger.log({"env_steps": row["env_steps"], "updates": row["updates"],
                        **({"eval_return": evals["eval_reward"]} if "eval_reward" in evals else {}), **evals})
        self.events(RowLogged(time.time(), self.index, dict(row)))
        return row

    def _stop_requested(self, row: dict) -> bool:
        """A stop signal, agreed by every trainer before the budget ends: the row says preempted."""
        if self.version >= self.cfg.total_steps or not self.stop.agreed(self.planes.trainer_host):
            return False
        row["preempted"] = 1.0
        if self.index == 0:
            print(f"hpcrl.ppo: stop requested ({self.stop.reason}); checkpoint at v{self.version}, "
                  "resume with --resume", flush=True)
        return True

    def _name_lost_trainer(self) -> None:
        """After a failed trainer collective: wait (up to the heartbeat timeout) until the lost trainer's
        heartbeat is stale, so the error can name it rather than just report the collective."""
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            self.makers.check_peers()  # raises PeerLost naming a dead trainer
            time.sleep(0.25)

    # start-up, checkpoints, shutdown --------------------------------------------------------------
    def _start(self) -> float:
        """Resume (or start fresh in a run dir the entry point found free, or cleared with --overwrite);
        trainer 0 writes the config. Returns the env steps so far."""
        cfg, run_dir = self.cfg, Path(self.cfg.run_dir)
        found = self._restore() if cfg.resume else None
        env_steps = self._load(found) if found is not None else 0.0
        self.carried = accounts.carried(found.path if found is not None else None, self.version)
        if self.index == 0:
            if found is None:  # a fresh start (the entry point refused a run dir holding another run)
                checkpoint.clear(run_dir)
            self._write_config(run_dir)
            rundir.clear_outcome(run_dir)  # until this run says how it ended (the batch scripts read it)
        return env_steps

    def _restore(self) -> checkpoint.Restored | None:
        """The newest checkpoint every trainer can load (collective over the trainers; an unusable newer
        one is reported and skipped); None with ``--resume-missing fresh`` and nothing to resume."""
        cfg = self.cfg
        found = self.checkpoints.restore(self.replica.strategy.restore_device)
        if found is None:
            checkpoint.fresh_or_refuse(cfg.run_dir, cfg.resume_missing, self.index == 0, "hpcrl.ppo")
        return found

    def _load(self, found: checkpoint.Restored) -> float:
        """Model, optimizer and learner (resharded to this job's trainers and strategy), then this
        trainer's generator and next credit (dealt by trainer_checkpoint's rule when the count changed)."""
        self.version, env_steps, generator, credit, ahead = self.checkpoints.load(found, self.replica.strategy)
        self.replica.generator.set_state(generator)
        # credits number the batches, and batch b is a fixed slice of a dataset workload's data
        # (Collector.assign): the first batch not trained on is the one to collect next
        self.makers.resume(credit, ahead)
        if self.index == 0 and found.world_size != self.top.trainers:
            print(f"hpcrl.ppo: resharded {found.world_size} -> {self.top.trainers} trainer(s) from {found.path} "
                  f"(v{self.version}; credits continue at {credit})", flush=True)
        if self.version > 0:
            self._publish()  # makers start from the initial weights: bring them to the resumed version
        return env_steps

    def _write_config(self, run_dir: Path) -> None:
        cfg, top, planes, device = self.cfg, self.top, self.planes, self.ctx.device
        names = hosts(self.ctx)
        rundir.write_text(run_dir / "config.json", json.dumps(
            {**dataclasses.asdict(cfg), "world_size": self.ctx.world_size, "launcher": self.ctx.source,
             "hosts": {"trainers": names[: top.trainers], "makers": names[top.trainers :]},
             "planes": {"trainers": planes.trainer_device.backend, "weights": planes.weights.backend}},
            indent=2, default=str))
        print(f"hpcrl.ppo: {top.makers} maker(s) : {top.trainers} trainer(s) via {self.ctx.source}; workload "
              f"{cfg.workload}; trainers on {device} ({planes.trainer_device.backend}), "
              f"{staging_note(planes, device)}; lag {cfg.lag} (cap {cfg.stale_cap}); "
              f"{cfg.batches_per_step} batch(es) per trainer per step; {cfg.total_steps} steps"
              + (f"; resuming at v{self.version}" if self.version else ""), flush=True)

    def _save(self, env_steps: float, wait: bool = False) -> Path | None:
        """A checkpoint of this version, written in the background (``wait``: until committed)."""
        # outstanding credits are collected again after a resume
        mine = {"generator": self.replica.generator.get_state(), "next_credit": self.makers.first_untrained,
                "taken_ahead": torch.tensor(self.makers.taken_ahead, dtype=torch.int64)}
        return self.checkpoints.save(self.version, env_steps, mine, wait=wait)

    def _finish(self, logger: RunLogger, tally: Tally, row: dict, reached: bool) -> dict:
        """Checkpoint, drain, close every stream; trainer 0 accounts for every sample and says how it ended."""
        consumed = tally.env_steps - tally.resumed_env_steps  # this job's makers produced only this job's samples
        saved = self._save(tally.env_steps, wait=True)
        if self.index == 0 and (line := self.checkpoints.timing_line()):
            print(f"hpcrl.ppo: {line}", flush=True)
        drained = self._drain()
        used = {f"used/{m}": float(n) for m, n in enumerate(self.makers.used)}
        totals = reduce_metrics({"dropped_shutdown": drained, "dropped_stale": tally.dropped_stale, **used},
                                self.planes.trainer_host, sums=["dropped_shutdown", "dropped_stale", *used])
        if self.publisher is not None:  # trainer 0
            self.publisher.end()  # after the last version
            self.makers.stop_all()
            produced = self.makers.produced(self.cfg.timeout_s)
            job = closing_row(produced, [totals[k] for k in used], self.makers.dead, consumed,
                              totals["dropped_shutdown"], totals["dropped_stale"])
            row.update(accounts.combine(self.carried, job))  # the whole run's, over every job so far
            if saved is not None:
                accounts.store(saved, {k: row[k] for k in (*accounts.KEYS, "accounts_since_update")})
            if not row.get("preempted"):  # one closing row, when the run finishes; a stopped job's wait in saved
                logger.log(row)
            self._report(logger, row, reached, tally.best, saved)
            if not row.get("preempted"):  # last: every sample is accounted for and the checkpoint written
                rundir.record_outcome(Path(self.cfg.run_dir), "finished", policy_version=self.version,
                                      makers_lost=len(self.makers.dead))
        logger.close()
        self.makers.join(self.cfg.heartbeat_timeout_s + 5.0)
        return row

    def _report(self, logger: RunLogger, row: dict, reached: bool, best: float, saved: Path | None) -> None:
        """The run's last lines (trainer 0): that --target-return was reached (update, return, time), or
        that the budget ended first, then the summary (final return, checkpoint, metrics)."""
        cfg = self.cfg
        recent = row.get("episode_return_recent", float("nan"))
        results: dict = {"episode_return_recent": recent, "updates": self.version, "env_steps": row.get("env_steps")}
        if reached:
            logger.early_stop(f"episode_return_recent {recent:.1f} >= --target-return {cfg.target_return:g}",
                              self.version)
        elif cfg.target_return is not None and not row.get("preempted"):
            shown = "-" if best != best else f"{best:.1f}"
            results["target_return"] = (f"{cfg.target_return:g} not reached in {cfg.total_steps} updates (best "
                                        f"episode_return_recent {shown}; raise --total-steps)")
        # an interrupted run says so (and how to continue), not "done"
        logger.finish(results, {"checkpoint": saved}, stopped=(self.stop.reason or "stop request") if row.get("preempted") else None)
