#!/usr/bin/env python
"""Detached PPO throughput (issue 4): detached makers/trainers vs the same processes with --lag 0 vs
single-process synchronous PPO, plus weight-sync time vs bytes.

    python benchmarks/ppo_throughput.py [--quick] [--json PATH] [--png PATH] [--no-lm]
                                        [--wait-load L] [--wait-max S]

All in ONE invocation, one torch thread per process, gloo on loopback (hpcrl.dist.spawn).

1. Controlled cost: ``SleepWorkload`` (defined here, loaded by the ranks as
   ``ppo_throughput:SleepWorkload``): a rollout sleeps ``rollout_s`` and an update sleeps
   ``train_s`` (40 ms each, 256 env steps per batch), so the numbers measure the pipeline, not
   the CPU (which other people share). "overhead ms/step" = ms/step minus the ideal (collect + update
   in series for single / lag 0; max(collect / makers, update) when pipelined), from the measured
   collect / update times. Detached 1 maker : 1 trainer and 2 : 1 with lag 1, the same
   with lag 0 (synchronous), and hpcrl.ppo.sync (one process, same workload). Target: detached 1:1
   >= 1.7x its lag-0 run (ideal 2x).
2. Real workloads: CartPole (registry defaults: 8 envs x 32 steps, 20 epochs x 1 minibatch) and,
   unless --quick / --no-lm, the token-level LM workload (pretrain_steps reduced to 50: it only
   shortens start-up; shapes and per-step cost are the registry defaults). These are CPU-bound: with
   2 cores shared with other users the comparison is only as good as the machine is quiet, so the
   collect / update wall and CPU times of every run are reported (wall >> cpu = descheduled).
3. Weight sync: hpcrl.ppo.transport.send_weights -> recv_weights (what trainer 0's publisher and a
   maker's weight thread run) between 2 ranks, fp32 vectors of 1/4/16/64 MiB, buckets of 1/4/16 MiB;
   end-to-end time = both checksums + all buckets + a 1-element ack; also one plain dist.send of the
   whole vector (no buckets, no checksum), and on one rank: transport.checksum alone, the same
   integer sum done in 1 MiB chunks (same value; no int64 copy of the whole vector), and the copy
   Trainer.publish makes on the trainer's main thread (ops.flatten(...).clone()) vs ops.flatten alone.
   Full run: also a detached run with a 16 MiB model (weight_sync_ms as the publisher reports it,
   and its throughput cost).

How the detached numbers are taken. Several runs share one set of ranks (one spawn per world
size; each run gets a fresh store namespace through TORCHELASTIC_RESTART_COUNT, which
hpcrl.dist.init_distributed reads), so process start-up is paid once. Inside the ranks this script
wraps (does not change) three hpcrl methods to timestamp them: RunLogger.log (absolute time of every
metrics row), Trainer.next_batch (lag of every consumed batch = trainer version - behaviour version,
as run.py computes it) and Maker._next_credit/_wait_for_version (the intervals that Maker.run counts
as ``wait_s``). Everything is measured over a steady window: from the row after the first 15 % of
steps (>= 2) to the last step; start-up (process launch, the first optimiser's torch._dynamo
import, LM pretraining) and shutdown are outside it. The single-process baseline (SyncPPO's collect + update, built by
hpcrl.ppo.run.build_workload from the same config) runs on rank 0 of the 2-rank spawn between the
detached runs (the other rank sleeps in the next run's rendezvous), so load changes hit both alike.
env-steps/s = env steps consumed in the window /
window; trainer idle = the rows' trainer_idle_frac weighted by step time; maker idle = time inside
wait intervals / window, mean over makers. Repeats are interleaved (lag 1, lag 0, lag 1, ...); the
median is reported, and the lag-1/lag-0 ratio is the median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # spawned ranks inherit sys.path: they import this file as ppo_throughput
from _timing import loadavg, machine_info, print_table, write_json  # noqa: E402

TARGET_RATIO = 1.7
MiB = 2**20


# -- the controlled-cost workload (imported by the ranks as "ppo_throughput:SleepWorkload") ----------

class SleepModel(nn.Module):
    def __init__(self, seed: int, param_mib: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(2, 4, generator=g) * 0.1)
            self.head.bias.zero_()
        n = int(param_mib * MiB) // 4
        # frozen ballast: published with the rest (sync_tensors = every parameter), never trained
        self.ballast = nn.Parameter(torch.randn(n, generator=g) if n else torch.zeros(0), requires_grad=False)


class SleepWorkload:
    """Rollout = sleep(rollout_s), update = sleep(train_s) + one tiny SGD step; ``samples`` env steps
    per batch; ``param_mib`` MiB of fp32 parameters published on every update."""

    name = "sleep"

    def __init__(self, rollout_s: float = 0.04, train_s: float = 0.04, samples: int = 256,
                 param_mib: float = 0.0) -> None:
        self.rollout_s, self.train_s, self.samples, self.param_mib = rollout_s, train_s, samples, param_mib

    def build_model(self, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        return SleepModel(seed, self.param_mib).to(device)

    def sync_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.data for p in model.parameters()]

    def after_sync(self, model: nn.Module) -> None:
        pass

    def make_collector(self, rank_seed: int, device: torch.device | str) -> "SleepCollector":
        return SleepCollector(self)

    def make_learner(self, model: nn.Module, cfg: Any, grad_sync: Any) -> "SleepLearner":
        return SleepLearner(self, model, grad_sync)


class SleepCollector:
    def __init__(self, w: SleepWorkload) -> None:
        self.w = w

    def collect(self, model: nn.Module, generator: torch.Generator):
        time.sleep(self.w.rollout_s)
        obs = torch.randn(self.w.samples, 4, generator=generator)
        with torch.no_grad():
            logp = torch.log_softmax(model.head(obs), -1)[:, 0]
        return ({"obs": obs, "behaviour_logp": logp},
                {"env_steps": float(self.w.samples), "episode_return_sum": 1.0, "episodes": 1.0})

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SleepLearner:
    def __init__(self, w: SleepWorkload, model: nn.Module, grad_sync: Any) -> None:
        self.w, self.model, self.sync = w, model, grad_sync

    def update(self, batches, generator):
        time.sleep(self.w.train_s)
        obs = torch.cat([b["obs"] for b in batches])
        self.model.zero_grad(set_to_none=True)
        self.model.head(obs).square().mean().backward()
        self.sync.all_reduce()
        with torch.no_grad():
            for p in self.model.head.parameters():
                p -= 0.01 * p.grad
            if self.model.ballast.numel():
                self.model.ballast[0] += 1.0  # every version differs (checksums too)
        return {"loss": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# -- inside the ranks ---------------------------------------------------------------------------------

_CAPTURE: dict[str, list] = {"rows": [], "lags": [], "waits": [], "phases": []}
_INSTRUMENTED = False


class _Timed:
    """Delegates to a collector / learner; times ``collect`` / ``update`` (wall and thread CPU)."""

    def __init__(self, inner: Any, phase: str) -> None:
        self._inner, self._phase = inner, phase

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _call(self, fn, *args):
        t, w0, c0 = time.time(), time.perf_counter(), time.thread_time()
        out = fn(*args)
        _CAPTURE["phases"].append((self._phase, t, time.perf_counter() - w0, time.thread_time() - c0))
        return out

    def collect(self, model, generator):
        return self._call(self._inner.collect, model, generator)

    def update(self, batches, generator):
        return self._call(self._inner.update, batches, generator)


class _TimedWorkload:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def make_collector(self, rank_seed, device):
        return _Timed(self._inner.make_collector(rank_seed, device), "collect")

    def make_learner(self, model, cfg, grad_sync):
        return _Timed(self._inner.make_learner(model, cfg, grad_sync), "update")


def _instrument() -> None:
    """Timestamp wrappers around hpcrl methods (behaviour unchanged); see the module docstring."""
    global _INSTRUMENTED
    if _INSTRUMENTED:
        return
    from hpcrl.ppo import roles, run

    class TimedLogger(run.RunLogger):
        def log(self, row):
            if self.enabled:
                _CAPTURE["rows"].append((time.time(), dict(row)))
            super().log(row)

    run.RunLogger = TimedLogger

    build_workload = run.build_workload

    def timed_build_workload(cfg):
        workload, ppo = build_workload(cfg)
        return _TimedWorkload(workload), ppo

    run.build_workload = timed_build_workload

    next_batch = roles.Trainer.next_batch

    def timed_next_batch(self):
        item = next_batch(self)
        _CAPTURE["lags"].append((time.time(), self.version - item.header.version))
        return item

    roles.Trainer.next_batch = timed_next_batch

    next_credit, wait_for_version = roles.Maker._next_credit, roles.Maker._wait_for_version

    def timed_next_credit(self):
        self._bench_t0 = time.time()
        return next_credit(self)

    def timed_wait_for_version(self, min_version):
        out = wait_for_version(self, min_version)
        _CAPTURE["waits"].append((self._bench_t0, time.time()))
        return out

    roles.Maker._next_credit = timed_next_credit
    roles.Maker._wait_for_version = timed_wait_for_version
    _INSTRUMENTED = True


def _run_ppo(cfg) -> dict[str, Any]:
    from hpcrl.ppo.run import train

    _instrument()
    for v in _CAPTURE.values():
        v.clear()
    c0, t0 = time.process_time(), time.time()
    out = train(cfg)
    return {"out": out, "rows": list(_CAPTURE["rows"]), "lags": list(_CAPTURE["lags"]),
            "waits": list(_CAPTURE["waits"]), "phases": list(_CAPTURE["phases"]), "t0": t0, "t1": time.time(),
            "cpu_s": time.process_time() - c0}


def _run_weight_sync(sizes_mib: list[float], buckets_mib: list[float], reps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hpcrl import ops
    from hpcrl.dist import init_distributed, shutdown
    from hpcrl.ppo import transport

    ctx = init_distributed(timeout_s=120)
    rank = ctx.rank
    ack = torch.zeros(1)
    timeout = timedelta(seconds=60)
    out: dict[str, Any] = {"transfers": [], "checksum": []}
    warm = torch.randn(MiB // 4) if rank == 0 else None
    for _ in range(3):  # first transfers of a fresh pair are slower: not part of any measurement
        if rank == 0:
            transport.send_weights(warm, 0, [1], MiB // 4, timeout)
        else:
            transport.recv_weights(0, torch.float32, MiB // 4)

    def timed(fn) -> list[float]:
        ts = []
        for i in range(warmup + n_reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if rank == 0:
                dist.recv(ack, 1, tag=99)
            else:
                dist.send(ack, 0, tag=99)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        return ts

    for size in sizes_mib:
        n_reps = max(reps, min(20, int(reps * 16 / size)))  # small transfers are noisier: more repeats
        n = int(size * MiB) // 4
        flat = torch.randn(n) if rank == 0 else torch.empty(n)
        for bucket in buckets_mib:
            numel = max(1, int(bucket * MiB) // 4)
            if rank == 0:
                fn = lambda: transport.send_weights(flat, 1, [1], numel, timeout)  # noqa: E731
            else:
                def fn():
                    _, got = transport.recv_weights(0, torch.float32, numel)
                    assert got is not None and got.numel() == n
            out["transfers"].append({"mib": size, "bucket_mib": bucket, "times_s": timed(fn)})
        fn = (lambda: dist.send(flat, 1, tag=98)) if rank == 0 else (lambda: dist.recv(flat, 0, tag=98))
        out["transfers"].append({"mib": size, "bucket_mib": None, "times_s": timed(fn)})  # raw send
        if rank == 0:
            bits = flat.view(torch.int32)
            expected = transport.checksum(flat)
            # chunked: the same integer sum without materialising an int64 copy of the whole vector
            def chunked() -> float:
                return float(sum(int(c.to(torch.int64).sum()) for c in bits.split(1 << 18)) % (1 << 52))

            assert chunked() == expected
            parts = list(flat.split(1 << 18))  # the model as 1 MiB tensors
            cases = {"checksum": lambda: transport.checksum(flat), "checksum_chunked": chunked,
                     "flatten": lambda: ops.flatten(parts), "flatten_clone": lambda: ops.flatten(parts).clone()}
            row: dict[str, Any] = {"mib": size}
            for name, fn in cases.items():
                ts = []
                for _ in range(warmup + n_reps):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                row[name + "_times_s"] = ts[warmup:]
            out["checksum"].append(row)
        del flat
    shutdown()
    return out


def _run_single_job(cfg) -> dict[str, Any]:
    from hpcrl.ppo import run

    workload, ppo = run.build_workload(cfg)  # the very workload and PPO config the detached runs use
    return run_single(workload, ppo, cfg.total_steps, cfg.seed)


def rank_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run several jobs in one set of ranks; a fresh store namespace per job (see module docstring)."""
    results = []
    for i, job in enumerate(jobs):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(1000 + i)
        if job["kind"] == "ppo":
            results.append(_run_ppo(job["cfg"]))
        elif job["kind"] == "single":  # rank 0 alone; the others wait in the next job's rendezvous
            results.append(_run_single_job(job["cfg"]) if os.environ.get("RANK") == "0" else None)
        else:
            results.append(_run_weight_sync(**job["args"]))
    return results


# -- analysis ---------------------------------------------------------------------------------------

def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def analyse_detached(results: list[dict[str, Any]], makers: int, trainers: int) -> dict[str, Any]:
    main = results[0]
    rows = [(t, r) for t, r in main["rows"] if "samples_produced" not in r]
    final = next((r for _, r in main["rows"] if "samples_produced" in r), {})
    n = len(rows)
    k0 = max(2, round(0.15 * n))
    t_lo, t_hi = rows[k0][0], rows[-1][0]
    window = t_hi - t_lo
    steps = rows[k0 + 1:]
    env = rows[-1][1]["env_steps"] - rows[k0][1]["env_steps"]
    dts = [rows[i][0] - rows[i - 1][0] for i in range(k0 + 1, n)]
    idle_t = sum(r["trainer_idle_frac"] * dt for (_, r), dt in zip(steps, dts)) / window
    maker_idle = [_overlap(res["waits"], t_lo, t_hi) / window for res in results[trainers:]]
    lags = [lag for t, lag in main["lags"] if t_lo < t <= t_hi]
    hist: dict[str, int] = {}
    for lag in sorted(lags):
        hist[str(lag)] = hist.get(str(lag), 0) + 1
    phases: dict[str, list[tuple[float, float]]] = {}
    for res in results:
        for name, t, wall, cpu in res["phases"]:
            if t_lo <= t <= t_hi:
                phases.setdefault(name, []).append((wall, cpu))
    phase_ms = {f"{name}_{kind}_ms": 1e3 * statistics.median(x[j] for x in v)
                for name, v in phases.items() for j, kind in ((0, "wall"), (1, "cpu"))}
    sync_ms = [r["weight_sync_ms"] for _, r in steps if r.get("weight_sync_ms") is not None
               and math.isfinite(r["weight_sync_ms"])]
    return {
        "env_steps_per_s": env / window,
        "ms_per_step": 1e3 * window / len(steps),
        "trainer_idle": idle_t,
        "maker_idle": statistics.mean(maker_idle),
        "maker_idle_each": maker_idle,
        # what the trainers log (maker_idle_frac): per-batch timing sent with the batches, where idle also
        # counts packing and the send queue; maker_idle above counts only credit and weight waits
        "maker_idle_logged": statistics.mean(r.get("maker_idle_frac", float("nan")) for _, r in steps),
        "lag_mean": statistics.mean(r["lag_mean"] for _, r in steps),
        "lag_max": max(r["lag_max"] for _, r in steps),
        "lag_min": min(r["lag_min"] for _, r in steps),
        "lag_hist": hist,
        "lag_mean_per_step": [r["lag_mean"] for _, r in rows],
        "lag_max_per_step": [r["lag_max"] for _, r in rows],
        "weight_sync_ms_median": statistics.median(sync_ms) if sync_ms else float("nan"),
        **phase_ms,
        "steps_total": n, "steps_window": len(steps), "window_s": window,
        "run_s": main["t1"] - main["t0"],
        "cpu_s_per_rank": [round(r["cpu_s"], 2) for r in results],
        "samples_produced": final.get("samples_produced"), "samples_consumed": final.get("samples_consumed"),
        "dropped_stale": final.get("dropped_stale"), "dropped_shutdown": final.get("dropped_shutdown"),
        "maker_wait_s_total": [r["out"].get("wait_s") for r in results[trainers:]],
    }


def run_single(workload: Any, ppo: Any, steps: int, seed: int = 0) -> dict[str, Any]:
    """hpcrl.ppo.sync's loop (SyncPPO.step = collect + update), timed per phase; same steady window."""
    from hpcrl.ppo.sync import SyncPPO

    run = SyncPPO(workload, ppo, seed, "cpu")
    times, collect, update, samples = [], [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        batch, stats = run.collector.collect(run.model, run.maker_generator)
        t1, c1 = time.perf_counter(), time.thread_time()
        run.learner.update([batch], run.learner_generator)
        t2, c2 = time.perf_counter(), time.thread_time()
        times.append(t2)
        collect.append((t1 - t0, c1 - c0))
        update.append((t2 - t1, c2 - c1))
        samples.append(stats["env_steps"])
    k0 = max(2, round(0.15 * steps))
    window = times[-1] - times[k0]
    med = lambda xs, j: 1e3 * statistics.median(x[j] for x in xs[k0 + 1:])  # noqa: E731
    return {"env_steps_per_s": sum(samples[k0 + 1:]) / window, "ms_per_step": 1e3 * window / (steps - k0 - 1),
            "collect_wall_ms": med(collect, 0), "collect_cpu_ms": med(collect, 1),
            "update_wall_ms": med(update, 0), "update_cpu_ms": med(update, 1),
            "steps_total": steps, "steps_window": steps - k0 - 1}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of every numeric field (the repeats themselves are kept)."""
    out: dict[str, Any] = {"repeats": len(runs), "runs": runs}
    for key in ("env_steps_per_s", "ms_per_step", "trainer_idle", "maker_idle", "lag_mean",
                "weight_sync_ms_median", "collect_wall_ms", "collect_cpu_ms", "update_wall_ms", "update_cpu_ms"):
        vals = [r[key] for r in runs if key in r and r[key] is not None and math.isfinite(r[key])]
        if vals:
            out[key] = statistics.median(vals)
    if runs and "lag_max" in runs[0]:
        out["lag_max"] = max(r["lag_max"] for r in runs)
        hist: dict[str, int] = {}
        for r in runs:
            for k, v in r["lag_hist"].items():
                hist[k] = hist.get(k, 0) + v
        out["lag_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        out["dropped_stale"] = sum(r["dropped_stale"] or 0 for r in runs)
        out["accounting_ok"] = all(
            r["samples_produced"] == r["samples_consumed"] + r["dropped_stale"] + r["dropped_shutdown"] for r in runs)
    return out


# -- plan -------------------------------------------------------------------------------------------

def detached_cfg(workload: str, makers: int, lag: int, steps: int, run_dir: str,
                 workload_args: dict[str, str] | None = None, bucket_mb: float = 16.0):
    from hpcrl.ppo.config import DetachedConfig

    return DetachedConfig(workload=workload, makers=makers, trainers=1, lag=lag, total_steps=steps, run_dir=run_dir,
                          workload_args=dict(workload_args or {}), bucket_mb=bucket_mb, timeout_s=90.0,
                          heartbeat_timeout_s=20.0, checkpoint_every=0, seed=0)


SLEEP = "ppo_throughput:SleepWorkload"


def plan(quick: bool, lm: bool, tmp: str) -> tuple[dict[int, list[dict]], dict[str, Any]]:
    """Jobs per world size (2: 1 maker : 1 trainer, 3: 2 : 1) and the parameters."""
    p = {
        "rollout_s": 0.04, "train_s": 0.04, "samples": 256,
        "ctrl_steps": 40 if quick else 80, "ctrl_reps": 1 if quick else 2,
        "cartpole_steps": 16 if quick else 40, "cartpole_reps": 1 if quick else 2,
        "lm": lm and not quick, "lm_steps": 16, "lm_reps": 2, "lm_args": {"pretrain_steps": "50"},
        "ws_sizes_mib": [1, 4, 16, 64], "ws_buckets_mib": [1, 4, 16] if not quick else [1, 16],
        "ws_reps": 3 if quick else 5, "ws_warmup": 1,
        "insitu_mib": None if quick else 16,
    }
    ctrl = {"rollout_s": str(p["rollout_s"]), "train_s": str(p["train_s"]), "samples": str(p["samples"])}
    jobs: dict[int, list[dict]] = {2: [], 3: []}
    counter = iter(range(10**6))

    def add(world: int, key: tuple, workload: str, lag: int, steps: int, args: dict | None = None,
            kind: str = "ppo") -> None:
        cfg = detached_cfg(workload, world - 1, lag, steps, os.path.join(tmp, f"run{next(counter)}"), args)
        jobs[world].append({"kind": kind, "key": key, "cfg": cfg})

    # interleaved: lag 1, lag 0, (single process on rank 0 while the others wait), lag 1, ...
    for world, topo in ((2, "1:1"), (3, "2:1")):
        for name, workload, steps, reps, args in (
                ("controlled", SLEEP, p["ctrl_steps"], p["ctrl_reps"], ctrl),
                ("cartpole", "cartpole", p["cartpole_steps"], p["cartpole_reps"], None),
                ("lm", "lm", p["lm_steps"], p["lm_reps"] if p["lm"] else 0, p["lm_args"])):
            for _ in range(reps):
                for lag in (1, 0):
                    add(world, (name, topo, lag), workload, lag, steps, args)
                if world == 2:
                    add(world, (name, "single", None), workload, 0, steps, args, kind="single")
    if p["insitu_mib"]:
        add(2, ("controlled_16MiB", "1:1", 1), SLEEP, 1, p["ctrl_steps"] // 2,
            {**ctrl, "param_mib": str(p["insitu_mib"])})
    jobs[2].append({"kind": "weights", "key": ("weight_sync",),
                    "args": {"sizes_mib": p["ws_sizes_mib"], "buckets_mib": p["ws_buckets_mib"],
                             "reps": p["ws_reps"], "warmup": p["ws_warmup"]}})
    return jobs, p


# -- plot -------------------------------------------------------------------------------------------

CONFIGS = [("single", None, None), ("1:1 lag 0", "1:1", 0), ("1:1 lag 1", "1:1", 1),
           ("2:1 lag 0", "2:1", 0), ("2:1 lag 1", "2:1", 1)]


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(14, 9))
    axes = [grid[0, 0], grid[1, 0], grid[1, 1]]
    ax = axes[0]
    top = 0.0
    workloads = [w for w in ("controlled", "cartpole", "lm") if w in payload["throughput"]]
    width = 0.8 / len(CONFIGS)
    for j, (label, _, _) in enumerate(CONFIGS):
        xs, ys, texts = [], [], []
        for i, w in enumerate(workloads):
            tp = payload["throughput"][w]
            if label in tp and "single" in tp:
                xs.append(i + (j - (len(CONFIGS) - 1) / 2) * width)
                ys.append(tp[label]["env_steps_per_s"] / tp["single"]["env_steps_per_s"])
                texts.append(f"{tp[label]['env_steps_per_s']:.0f}")
        bars = ax.bar(xs, ys, width, label=label)
        top = max([top] + ys)
        for b, t in zip(bars, texts):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), t, ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("env-steps/s relative to single process\n(numbers on bars: env-steps/s)")
    ax.set_title("throughput (1 thread/process)")
    ax.legend(fontsize=7)

    ax = grid[0, 1]  # idle fractions
    labels = [lbl for lbl, topo, _ in CONFIGS if topo]
    width = 0.8 / (2 * len(workloads))
    for i, w in enumerate(workloads):
        tp = payload["throughput"][w]
        for j, (role, key, hatch) in enumerate((("trainer", "trainer_idle", ""), ("maker", "maker_idle", "//"))):
            off = (2 * i + j - (2 * len(workloads) - 1) / 2) * width
            ax.bar([k + off for k in range(len(labels))], [100 * tp.get(lbl, {}).get(key, 0.0) for lbl in labels],
                   width, hatch=hatch, color=f"C{i}", alpha=0.9 if j == 0 else 0.5, label=f"{w}: {role} idle")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("% of the steady window")
    ax.set_ylim(0, 125)
    ax.set_title("idle: trainer (waits for experience), maker (waits for credit / weights)", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper center")

    ax = axes[1]
    ctrl = payload["throughput"]["controlled"]
    labels = [lbl for lbl, topo, _ in CONFIGS if topo and lbl in ctrl]
    lag_values = sorted({int(k) for lbl in labels for k in ctrl[lbl]["lag_hist"]})
    width = 0.8 / max(1, len(lag_values))
    for j, lag in enumerate(lag_values):
        fracs = []
        for lbl in labels:
            h = ctrl[lbl]["lag_hist"]
            fracs.append(h.get(str(lag), 0) / max(1, sum(h.values())))
        ax.bar([i + (j - (len(lag_values) - 1) / 2) * width for i in range(len(labels))], fracs, width,
               label=f"lag {lag}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("fraction of consumed batches")
    ax.set_title("lag histogram (controlled workload, steady window)")
    ax.legend(fontsize=7)

    ax = axes[2]
    ws = payload["weight_sync"]
    for bucket in ws["buckets_mib"] + [None]:
        pts = [r for r in ws["table"] if r["bucket_mib"] == bucket]
        ax.plot([r["mib"] for r in pts], [r["ms"] for r in pts], "o-" if bucket else "k--",
                label=f"send_weights, bucket {bucket:g} MiB" if bucket else "plain dist.send (no buckets/checksum)")
    ax.plot([r["mib"] for r in ws["checksum"]], [r["checksum_ms"] for r in ws["checksum"]], "x:", color="gray",
            label="transport.checksum() alone (one side)")
    ax.plot([r["mib"] for r in ws["checksum"]], [r["flatten_clone_ms"] for r in ws["checksum"]], "+:", color="brown",
            label="Trainer.publish copy: flatten().clone()")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fp32 parameters (MiB)")
    ax.set_ylabel("ms per publish (1 receiver)")
    ax.set_title("weight sync, gloo loopback")
    ax.legend(fontsize=7)
    m = payload["machine"]
    fig.suptitle(f"hpcrl detached PPO - {m['cpu_model']}, {m['cpu_count']} cpus, torch {m['torch']}, "
                 f"load {m['loadavg_start']} -> {m.get('loadavg_end')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------------

def wait_quiet(limit: float, max_wait: float) -> dict[str, Any]:
    t0 = time.time()
    before = loadavg()
    while limit > 0 and os.getloadavg()[0] > limit and time.time() - t0 < max_wait:
        time.sleep(10)
    return {"limit": limit, "max_wait_s": max_wait, "waited_s": round(time.time() - t0, 1),
            "loadavg_before_wait": before, "loadavg_after_wait": loadavg()}


def _phases(r: dict[str, Any]) -> str:
    return ", ".join(f"{p} {r[p + '_wall_ms']:.1f} ms (cpu {r[p + '_cpu_ms']:.1f})"
                     for p in ("collect", "update") if p + "_wall_ms" in r)


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer steps and repeats, no LM, no in-situ 16 MiB run (< 2 min)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/ppo_throughput.json")
    ap.add_argument("--png", default=None, help="default: the JSON path with .png")
    ap.add_argument("--no-lm", action="store_true", help="skip the LM workload in the full run")
    ap.add_argument("--wait-load", type=float, default=2.5, help="wait while the 1-min load average is above this")
    ap.add_argument("--wait-max", type=float, default=None,
                    help="longest wait for a quiet machine, s (default 120; quick 15)")
    args = ap.parse_args()
    quick = args.quick
    json_path = Path(args.json or os.path.join(HERE, "results", "ppo_throughput.json"))
    png_path = Path(args.png) if args.png else json_path.with_suffix(".png")
    torch.set_num_threads(1)

    import ppo_throughput as bench  # the ranks unpickle bench.rank_worker by this module name
    from hpcrl.dist import spawn

    info = machine_info("cpu", 1)
    wait_max = args.wait_max if args.wait_max is not None else (15.0 if quick else 120.0)
    info["wait"] = wait_quiet(args.wait_load, wait_max)
    info["loadavg_start"] = loadavg()
    t_start = time.perf_counter()
    print(f"ppo_throughput: {info['cpu_model']}, {info['cpu_count']} cpus, torch {info['torch']}, 1 thread/process, "
          f"load {info['loadavg_start']} (waited {info['wait']['waited_s']} s for < {args.wait_load})"
          + (" [quick]" if quick else ""), flush=True)
    payload: dict[str, Any] = {"benchmark": "ppo_throughput", "quick": quick, "machine": info,
                               "target": {"detached_1to1_over_lag0": TARGET_RATIO, "ideal": 2.0}}
    seconds: dict[str, float] = {}
    tmp = tempfile.mkdtemp(prefix="ppo-throughput-")
    try:
        jobs, params = plan(quick, not args.no_lm, tmp)
        payload["params"] = params
        raw: dict[tuple, list[dict]] = {}
        ws_raw = None
        for world in (2, 3):
            t = time.perf_counter()
            print(f"\nspawning {world} ranks ({world - 1} maker(s) : 1 trainer) for {len(jobs[world])} runs ...",
                  flush=True)
            per_rank = spawn(bench.rank_worker, world, args=(jobs[world],), timeout_s=600)
            seconds[f"world{world}"] = time.perf_counter() - t
            for j, job in enumerate(jobs[world]):
                results = [per_rank[r][j] for r in range(world)]
                if job["kind"] == "weights":
                    ws_raw = results[0]
                    continue
                if job["kind"] == "single":
                    res = results[0]
                    raw.setdefault(job["key"], []).append(res)
                    print(f"  {job['key'][0]:17s} single   : {res['env_steps_per_s']:8.0f} env-steps/s, "
                          f"{res['ms_per_step']:6.1f} ms/step, {_phases(res)}", flush=True)
                    continue
                res = analyse_detached(results, world - 1, 1)
                raw.setdefault(job["key"], []).append(res)
                w, topo, lag = job["key"]
                print(f"  {w:17s} {topo} lag {lag}: {res['env_steps_per_s']:8.0f} env-steps/s, "
                      f"{res['ms_per_step']:6.1f} ms/step, trainer idle {fmt_pct(res['trainer_idle'])}, maker idle "
                      f"{fmt_pct(res['maker_idle'])}, lags {res['lag_hist']}, {_phases(res)}, run {res['run_s']:.1f} s",
                      flush=True)

        singles = {key[0]: summarise(runs) for key, runs in raw.items() if key[1] == "single"}

        # assemble
        throughput: dict[str, dict[str, Any]] = {}
        for w in singles:
            tp = {"single": singles[w]}
            for label, topo, lag in CONFIGS[1:]:
                if (w, topo, lag) in raw:
                    tp[label] = summarise(raw[(w, topo, lag)])
            for topo in ("1:1", "2:1"):
                a, b = raw.get((w, topo, 1), []), raw.get((w, topo, 0), [])
                if a and b:
                    ratios = [x["env_steps_per_s"] / y["env_steps_per_s"] for x, y in zip(a, b)]
                    tp[f"{topo} lag 1"]["over_lag0"] = statistics.median(ratios)
                    tp[f"{topo} lag 1"]["over_lag0_each"] = ratios
            for label, s in tp.items():
                s["over_single"] = s["env_steps_per_s"] / tp["single"]["env_steps_per_s"]
                # ms/step beyond the ideal: collect + update in series (single, lag 0), the slower of the
                # two per trainer step when pipelined (lag >= 1; makers share the collect work)
                c, u = s.get("collect_wall_ms"), s.get("update_wall_ms")
                if c is not None and u is not None:
                    n_makers = 2 if label.startswith("2:1") else 1
                    ideal = c + u if label == "single" or label.endswith("lag 0") else max(c / n_makers, u)
                    s["overhead_ms"] = s["ms_per_step"] - ideal
            throughput[w] = tp
        payload["throughput"] = throughput
        if ("controlled_16MiB", "1:1", 1) in raw:
            payload["insitu_16MiB"] = summarise(raw[("controlled_16MiB", "1:1", 1)])

        # weight sync table
        assert ws_raw is not None
        table = []
        for tr in ws_raw["transfers"]:
            ms = 1e3 * statistics.median(tr["times_s"])
            table.append({"mib": tr["mib"], "bucket_mib": tr["bucket_mib"], "ms": ms,
                          "ms_min": 1e3 * min(tr["times_s"]),
                          "gb_per_s": tr["mib"] * MiB / (ms / 1e3) / 1e9, "times_s": tr["times_s"]})
        checks = [{"mib": c["mib"], **{k.removesuffix("_times_s") + "_ms": 1e3 * statistics.median(v)
                                       for k, v in c.items() if k.endswith("_times_s")}} for c in ws_raw["checksum"]]
        payload["weight_sync"] = {"sizes_mib": params["ws_sizes_mib"], "buckets_mib": params["ws_buckets_mib"],
                                  "table": table, "checksum": checks,
                                  "note": "end-to-end send_weights -> recv_weights (+1-element ack), 1 receiver, "
                                          "median of repeats; bucket None = one plain dist.send, no checksum"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    info["loadavg_end"] = loadavg()
    seconds["total"] = time.perf_counter() - t_start
    payload["seconds"] = {k: round(v, 1) for k, v in seconds.items()}

    # tables
    ctrl = throughput["controlled"]
    print_table(f"1. controlled cost (rollout {1e3 * params['rollout_s']:.0f} ms, "
                f"update {1e3 * params['train_s']:.0f} ms, "
                f"{params['samples']} env steps/batch; median of {params['ctrl_reps']} run(s) x "
                f"{ctrl['1:1 lag 1']['runs'][0]['steps_window']} steady steps)",
                ["config", "env-steps/s", "ms/step", "overhead ms/step", "vs single", "vs lag 0", "trainer idle",
                 "maker idle", "lag mean", "lag max", "lag histogram", "dropped"],
                [[label, f"{ctrl[label]['env_steps_per_s']:.0f}", f"{ctrl[label]['ms_per_step']:.1f}",
                  f"{ctrl[label]['overhead_ms']:.1f}",
                  f"{ctrl[label]['over_single']:.2f}x",
                  f"{ctrl[label]['over_lag0']:.2f}x" if "over_lag0" in ctrl[label] else "",
                  fmt_pct(ctrl[label].get("trainer_idle")), fmt_pct(ctrl[label].get("maker_idle")),
                  f"{ctrl[label]['lag_mean']:.2f}" if "lag_mean" in ctrl[label] else "",
                  f"{ctrl[label]['lag_max']:g}" if "lag_max" in ctrl[label] else "",
                  " ".join(f"{k}:{v}" for k, v in ctrl[label].get("lag_hist", {}).items()),
                  f"{ctrl[label]['dropped_stale']:g}" if "dropped_stale" in ctrl[label] else ""]
                 for label, _, _ in CONFIGS if label in ctrl])
    ratio = ctrl["1:1 lag 1"]["over_lag0"]
    print(f"detached 1:1 / its lag 0 = {ratio:.2f}x (each repeat: "
          f"{', '.join(f'{x:.2f}' for x in ctrl['1:1 lag 1']['over_lag0_each'])}); "
          f"target >= {TARGET_RATIO}x, ideal 2x: "
          f"{'MET' if ratio >= TARGET_RATIO else 'MISSED'}", flush=True)
    rows = []
    for w in ("cartpole", "lm"):
        if w not in throughput:
            continue
        tp = throughput[w]
        for label, _, _ in CONFIGS:
            if label in tp:
                s = tp[label]
                rows.append([w, label, f"{s['env_steps_per_s']:.0f}", f"{s['ms_per_step']:.1f}",
                             f"{s['over_single']:.2f}x", f"{s['over_lag0']:.2f}x" if "over_lag0" in s else "",
                             fmt_pct(s.get("trainer_idle")), fmt_pct(s.get("maker_idle")),
                             " ".join(f"{k}:{v}" for k, v in s.get("lag_hist", {}).items()),
                             f"{s['collect_wall_ms']:.1f} / {s['collect_cpu_ms']:.1f}",
                             f"{s['update_wall_ms']:.1f} / {s['update_cpu_ms']:.1f}",
                             f"{100 * (1 - s['update_cpu_ms'] / s['update_wall_ms']):.0f} %"])
    print_table("2. real workloads (median of repeats; CPU-bound: the processes share 2 cores with other users)",
                ["workload", "config", "env-steps/s", "ms/step", "vs single", "vs lag 0", "trainer idle", "maker idle",
                 "lag histogram", "collect ms wall / cpu", "update ms wall / cpu", "update descheduled"], rows)
    print("update descheduled = 1 - cpu / wall of the trainer's update: time the trainer thread waited for a core "
          "(other users' load, or our own maker on the second core); large values make that row's comparison unfair.")
    ws = payload["weight_sync"]
    sizes = ws["sizes_mib"]
    hdr = ["MiB"] + [f"bucket {b:g} MiB: ms (GB/s)" for b in ws["buckets_mib"]] + [
        "plain send ms (GB/s)", "checksum ms (1 side)", "chunked checksum ms", "flatten ms", "flatten+clone ms"]
    trows = []
    for size in sizes:
        cells = [f"{size:g}"]
        for b in ws["buckets_mib"] + [None]:
            r = next(r for r in ws["table"] if r["mib"] == size and r["bucket_mib"] == b)
            cells.append(f"{r['ms']:.1f} ({r['gb_per_s']:.2f})")
        c = next(c for c in ws["checksum"] if c["mib"] == size)
        cells += [f"{c[k]:.1f}" for k in ("checksum_ms", "checksum_chunked_ms", "flatten_ms", "flatten_clone_ms")]
        trows.append(cells)
    print_table("3. weight sync, send_weights -> recv_weights, gloo loopback, 1 receiver (median)", hdr, trows)
    if "insitu_16MiB" in payload:
        s = payload["insitu_16MiB"]
        base = ctrl["1:1 lag 1"]
        print(f"in-situ: controlled 1:1 lag 1 with a 16 MiB model: {s['env_steps_per_s']:.0f} env-steps/s "
              f"({s['env_steps_per_s'] / base['env_steps_per_s']:.2f}x the tiny-model run), publisher weight_sync_ms "
              f"median {s.get('weight_sync_ms_median', float('nan')):.1f}, "
              f"trainer idle {fmt_pct(s.get('trainer_idle'))}, "
              f"maker idle {fmt_pct(s.get('maker_idle'))}, lags {s.get('lag_hist')}")

    payload["summary"] = {
        "detached_1to1_over_lag0": ratio, "target_met": ratio >= TARGET_RATIO,
        "detached_2to1_over_lag0": ctrl.get("2:1 lag 1", {}).get("over_lag0"),
        "controlled_env_steps_per_s": {k: v["env_steps_per_s"] for k, v in ctrl.items()},
        "cartpole_env_steps_per_s": {k: v["env_steps_per_s"] for k, v in throughput["cartpole"].items()},
    }
    write_json(json_path, _nan_to_none(payload))
    plot(payload, png_path)
    print(f"\nload average start {info['loadavg_start']} end {info['loadavg_end']}; sections (s): {payload['seconds']}"
          f"\nJSON: {json_path}\nPNG:  {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
