"""One rank of a detached-PPO job: bootstrap, take the role the rank says, run it."""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl import checkpoint
from hpcrl.dist import DistContext, StopRequest, init_distributed, shutdown
from hpcrl.metrics import RunLogger

from .config import DetachedConfig
from .liveness import Heartbeat
from .roles import STOP, Maker, PeerLost, Trainer
from .transport import TAG_CREDIT
from .topology import Topology
from .workload import PPOConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def build_workload(cfg: DetachedConfig):
    """A registered workload name, or ``package.module:Class`` for a user's own workload."""
    try:
        if ":" in cfg.workload:
            module, _, attr = cfg.workload.partition(":")
            workload = getattr(importlib.import_module(module), attr)(**cfg.workload_kwargs())
        else:
            from .workloads import make_workload

            workload = make_workload(cfg.workload, **cfg.workload_kwargs())
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        raise ConfigError(f"workload {cfg.workload!r}: {err}") from None
    ppo = workload.default_config() if hasattr(workload, "default_config") else PPOConfig()
    try:
        ppo = dataclasses.replace(ppo, **cfg.ppo_kwargs())
    except TypeError as err:
        raise ConfigError(f"ppo_args: {err}") from None
    return workload, ppo


def validate(cfg: DetachedConfig, world_size: int) -> Topology:
    top = Topology(cfg.trainers, cfg.makers)
    if world_size != top.world_size:
        raise ConfigError(f"--trainers {cfg.trainers} + --makers {cfg.makers} = {top.world_size} ranks, but the "
                          f"launcher started {world_size}; start {top.world_size} tasks or change the counts")
    for name in ("batches_per_step", "total_steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.lag < 0 or cfg.stale_cap < cfg.lag:
        raise ConfigError(f"need 0 <= lag <= max_lag, got lag={cfg.lag}, max_lag={cfg.max_lag}")
    return top


def train(cfg: DetachedConfig) -> dict[str, float]:
    stop = StopRequest.install()  # makers only record it: trainers decide, then send STOP credits
    torch.set_num_threads(cfg.threads)
    ctx = init_distributed(timeout_s=cfg.timeout_s)
    top = validate(cfg, ctx.world_size)
    workload, ppo = build_workload(cfg)
    ctx.store.set(f"host/{ctx.rank}", ctx.hostname)
    # Every rank joins every new_group call, in the same order (a torch.distributed rule).
    # (a group even for one trainer: GradSync and the metric reductions must never span the makers)
    trainer_group = dist.new_group(list(range(top.trainers)), timeout=ctx.timeout)
    # Publisher -> makers: its own connections, so weight buckets never delay credits or experience.
    weight_group = dist.new_group([0] + [top.maker_rank(m) for m in range(top.makers)], timeout=ctx.timeout)
    beat = Heartbeat(ctx.store, ctx.rank)
    try:
        if top.role(ctx.rank) == "maker":
            out = Maker(ctx, top, cfg, workload, ppo, weight_group).run()
        else:
            out = _train_loop(ctx, top, cfg, Trainer(ctx, top, cfg, workload, ppo, trainer_group, weight_group), stop)
    finally:
        beat.stop()
    shutdown()
    return out


def _trainer_sum(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


def _trainer_max(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _train_loop(ctx: DistContext, top: Topology, cfg: DetachedConfig, tr: Trainer,
                stop: StopRequest) -> dict[str, float]:
    run_dir = Path(cfg.run_dir)
    main = tr.index == 0
    env_steps = 0.0
    if cfg.resume and (ck := checkpoint.latest(run_dir)) is not None:
        learner_state, mine = checkpoint.load(ck, tr.index, top.trainers, tr.device)
        tr.model.load_state_dict(learner_state["model"])
        tr.learner.load_state_dict(learner_state["learner"])
        tr.version = int(learner_state["version"])
        env_steps = float(learner_state["env_steps"])
        tr.generator.set_state(mine["generator"])
        if tr.version > 0:
            tr.publish()  # makers start from the initial weights: bring them to the resumed version
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ctx.store.wait([f"host/{r}" for r in range(top.world_size)])
        hosts = [ctx.store.get(f"host/{r}").decode() for r in range(top.world_size)]
        (run_dir / "config.json").write_text(json.dumps(
            {**dataclasses.asdict(cfg), "world_size": ctx.world_size, "launcher": ctx.source,
             "hosts": {"trainers": hosts[: top.trainers], "makers": hosts[top.trainers :]}}, indent=2, default=str))
        print(f"hpcrl.ppo: {top.makers} maker(s) : {top.trainers} trainer(s) via {ctx.source}; workload "
              f"{cfg.workload}; lag {cfg.lag} (cap {cfg.stale_cap}); {cfg.batches_per_step} batch(es) per trainer "
              f"per step; {cfg.total_steps} steps" + (f"; resuming at v{tr.version}" if tr.version else ""), flush=True)
    resumed_env_steps = env_steps
    logger = RunLogger(run_dir, main, cfg.total_steps, resume_env_steps=int(env_steps), progress_key="updates")
    start_version = tr.version
    tr.grant((cfg.lag + 1) * cfg.batches_per_step)
    dropped_stale = 0.0
    recent: deque[tuple[float, float]] = deque()  # (return sum, episodes) of the latest steps
    row: dict[str, float] = {}
    last = time.perf_counter()
    for _ in range(start_version, cfg.total_steps):
        batches, lags, stats_sum = [], [], {}
        wait_t0 = time.perf_counter()
        while len(batches) < cfg.batches_per_step:
            item = tr.next_batch()
            lag = tr.version - item.header.version
            data, stats = tr._schema().unpack(item.payload)
            if lag > cfg.stale_cap:
                dropped_stale += item.header.samples
                tr.grant(1)
                for k in ("maker_wait_s", "maker_busy_s"):  # the makers' time was spent all the same
                    stats_sum[k] = stats_sum.get(k, 0.0) + stats.get(k, 0.0)
                continue
            batches.append(data)
            lags.append(lag)
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v
        wait_s = time.perf_counter() - wait_t0
        try:
            learn = tr.learner.update(batches, tr.generator)
        except RuntimeError as err:  # a collective of the trainer group failed: name who is missing
            tr._check_peers()
            raise PeerLost(f"trainer {tr.index}: gradient all-reduce failed: {err}") from err
        tr.version += 1
        tr.publish()
        tr.grant(cfg.batches_per_step)

        samples = stats_sum.get("env_steps", 0.0)
        names = sorted(learn)
        summed = _trainer_sum([samples, stats_sum.get("episode_return_sum", 0.0), stats_sum.get("episodes", 0.0),
                               sum(lags), len(lags), wait_s, dropped_stale, stats_sum.get("maker_wait_s", 0.0),
                               stats_sum.get("maker_busy_s", 0.0)] + [learn[k] for k in names], tr.group)
        lag_max, neg_lag_min = _trainer_max([max(lags), -min(lags)], tr.group)
        env_steps += summed[0]
        now = time.perf_counter()
        n_tr = top.trainers
        row = {"env_steps": int(env_steps), "updates": tr.version, "policy_version": tr.version,
               "episode_return": summed[1] / summed[2] if summed[2] else float("nan"),
               "episode_return_recent": _recent_mean(recent, summed[1], summed[2]),
               "lag_mean": summed[3] / summed[4], "lag_max": lag_max, "lag_min": -neg_lag_min, "dropped_stale": summed[6],
               "weight_sync_ms": tr.publish_ms, "samples_per_s": summed[0] / max(now - last, 1e-9),
               "trainer_idle_frac": (summed[5] / n_tr) / max(now - last, 1e-9),
               # of the makers' time behind this step's batches, the share not spent collecting
               "maker_idle_frac": summed[7] / max(summed[7] + summed[8], 1e-9),
               **{k: summed[9 + i] / n_tr for i, k in enumerate(names)}}
        row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
        last = now
        logger.log(row)
        if cfg.checkpoint_every and tr.version % cfg.checkpoint_every == 0:
            _save(ctx, top, cfg, tr, env_steps)
        # Every trainer sees the same reduced row, so they all stop at the same step.
        if cfg.target_return is not None and row["episode_return_recent"] >= cfg.target_return:
            break
        if tr.version < cfg.total_steps and stop.agreed(tr.group):
            row["preempted"] = 1.0
            if main:
                print(f"hpcrl.ppo: stop requested ({stop.reason}); checkpoint at v{tr.version}, "
                      "resume with --resume", flush=True)
            break
    consumed = env_steps - resumed_env_steps  # this job's makers produced only this job's samples
    _save(ctx, top, cfg, tr, env_steps)
    dropped_shutdown = _drain(tr, cfg)
    totals = _trainer_sum([dropped_shutdown, dropped_stale], tr.group)
    tr.stop_publisher()
    if main:
        for m in range(top.makers):
            if m not in tr.dead:
                dist.send(torch.tensor([STOP, 0.0, 0.0], dtype=torch.float64), top.maker_rank(m), tag=TAG_CREDIT)
        produced = 0.0
        for m in range(top.makers):
            if m in tr.dead:
                continue
            ctx.store.wait([f"ppo/produced/{m}"])
            produced += float(ctx.store.get(f"ppo/produced/{m}").decode())
        row.update(samples_produced=produced, samples_consumed=consumed, dropped_shutdown=totals[0],
                   dropped_stale=totals[1], makers_lost=float(len(tr.dead)))
        logger.log(row)
    logger.close()
    for thread in tr.threads:  # makers close their streams after the STOP credit
        thread.join(timeout=cfg.timeout_s)
    return row


def _recent_mean(recent: deque, return_sum: float, episodes: float, min_episodes: int = 20) -> float:
    """Mean return over the latest steps that together finished >= ``min_episodes`` episodes."""
    recent.append((return_sum, episodes))
    while len(recent) > 1 and sum(n for _, n in recent) - recent[0][1] >= min_episodes:
        recent.popleft()
    total = sum(n for _, n in recent)
    return sum(r for r, _ in recent) / total if total >= min_episodes else float("nan")


def _drain(tr: Trainer, cfg: DetachedConfig) -> float:
    """Collect every outstanding rollout (or give up on dead makers); count them as dropped at shutdown."""
    dropped = 0.0
    deadline = time.monotonic() + cfg.timeout_s
    while tr._pending and time.monotonic() < deadline:
        dropped += tr.next_batch().header.samples
    return dropped


def _save(ctx: DistContext, top: Topology, cfg: DetachedConfig, tr: Trainer, env_steps: float) -> None:
    group = tr.group

    def trainer_barrier(name: str) -> None:
        if group is not None:
            dist.barrier(group=group)

    learner = ({"model": tr.model.state_dict(), "learner": tr.learner.state_dict(), "version": tr.version,
                "env_steps": env_steps}
               if tr.index == 0 else None)
    checkpoint.save(cfg.run_dir, tr.version, tr.index, top.trainers, learner, {"generator": tr.generator.get_state()},
                    trainer_barrier)
