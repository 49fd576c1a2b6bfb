#!/usr/bin/env python
"""Detached PPO throughput: detached makers/trainers vs the same processes with --lag 0 vs
single-process synchronous PPO, timed from detached PPO's events hook.

    python benchmarks/ppo/ppo_throughput.py [--quick] [--json PATH] [--png PATH] [--no-lm]
                                        [--wait-load L] [--wait-max S]

All in ONE invocation, one torch thread per process, gloo on loopback (hpcrl.comm.spawn).

1. Controlled cost: ``SleepWorkload`` (defined here): a rollout sleeps ``rollout_s`` and an update
   sleeps ``train_s`` (40 ms each, 256 env steps per batch), so the numbers measure the pipeline, not
   the CPU (which other people share). "overhead ms/step" = ms/step minus the ideal (collect + update
   in series for single / lag 0; max(collect / makers, update) when pipelined), from the measured
   collect / update times. Detached 1 maker : 1 trainer and 2 : 1 with lag 1, the same with lag 0
   (synchronous), and hpcrl.ppo.sync (one process, same workload). Target: detached 1:1 >= 1.7x its
   lag-0 run (ideal 2x).
2. Real workloads: CartPole (registry defaults: 8 envs x 32 steps, 20 epochs x 1 minibatch) and,
   unless --quick / --no-lm, the token-level LM workload (pretrain_steps reduced to 50: it only
   shortens start-up; shapes and per-step cost are the registry defaults). These are CPU-bound: with
   2 cores shared with other users the comparison is only as good as the machine is quiet, so the
   collect / update wall and CPU times of every run are reported (wall >> cpu = descheduled).
3. Weights: every run reports trainer 0's publish time per version (``WeightsPublished.seconds``);
   the full run adds a controlled 1:1 lag-1 run with a 16 MiB model (its publish time and throughput
   cost). Publish time vs size and number of makers, broadcast vs point-to-point:
   benchmarks/ppo/weight_publish.py.

How the numbers are taken, with public interfaces only. Every run is ``hpcrl.ppo.train(cfg,
events=Capture())``: :class:`RowLogged` gives each metrics row and its time, :class:`BatchReceived`
the lag of each consumed batch (trainer version - behaviour version), :class:`RolloutDone` each
maker's wait interval (wait_start -> collect_start: since its previous rollout ended, i.e. packing,
send queue, credit and weights) and collect interval, :class:`WeightsPublished` each publish. The
workload is ``ppo_throughput:TimedWorkload`` (``--inner NAME --inner-args "FLAGS"``: the workload NAME,
a registry name or ``package.module:Class``, built from FLAGS as hpcrl.ppo takes them), which times ``collect`` /
``update`` (wall and thread CPU); the ranks import this file as ``ppo_throughput`` because spawned
ranks inherit sys.path, to which this script adds benchmarks/ppo/. Several runs share one set of ranks
(one spawn per world size; each run gets a fresh store namespace through
TORCHELASTIC_RESTART_COUNT, which hpcrl.comm.init_distributed reads), so process start-up is paid
once. Everything is measured over a steady window: from the row after the first 15 % of steps
(>= 2) to the last step; start-up (process launch, the first optimiser's torch._dynamo import, LM
pretraining) and shutdown are outside it. The single-process baseline (hpcrl.ppo.sync.SyncPPO on
the workload hpcrl.ppo.run.build_workload makes of the same config) runs on rank 0 of the 2-rank
spawn between the detached runs (the other rank waits in the next run's rendezvous), so load
changes hit both alike. env-steps/s = env steps consumed in the window / window; trainer idle =
the rows' trainer_idle_frac weighted by step time; maker idle = time inside wait intervals /
window, mean over makers. Repeats are interleaved (lag 1, lag 0, single, lag 1, ...); the median is
reported, and the lag-1/lag-0 ratio is the median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # spawned ranks inherit sys.path: they import this file as ppo_throughput
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # benchmarks.common, hpcrl
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, machine_info, print_table, write_json  # noqa: E402

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
        # frozen ballast: published with the rest (publish_tensors = every parameter), never trained
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

    def publish_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.data for p in model.parameters()]

    def after_publish(self, model: nn.Module) -> None:
        pass

    def make_collector(self, rank_seed: int, device: torch.device | str) -> "SleepCollector":
        return SleepCollector(self)

    def make_learner(self, model: nn.Module, cfg: Any, grad_average: Any) -> "SleepLearner":
        return SleepLearner(self, model, grad_average)


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
    def __init__(self, w: SleepWorkload, model: nn.Module, grad_average: Any) -> None:
        self.w, self.model, self.averager = w, model, grad_average

    def update(self, batches, generator):
        time.sleep(self.w.train_s)
        obs = torch.cat([b["obs"] for b in batches])
        self.model.zero_grad(set_to_none=True)
        self.model.head(obs).square().mean().backward()
        self.averager.all_reduce()
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


# -- the timed workload (imported by the ranks as "ppo_throughput:TimedWorkload") -------------------

PHASES: list[tuple[str, float, float, float]] = []  # this process: (phase, time, wall s, thread cpu s)


class _Timed:
    """Delegates to a collector / learner; times ``collect`` / ``update`` (wall and thread CPU)."""

    def __init__(self, inner: Any, phase: str) -> None:
        self._inner, self._phase = inner, phase

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _call(self, fn, *args):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        PHASES.append((self._phase, time.time(), time.perf_counter() - w0, time.thread_time() - c0))
        return out

    def collect(self, model, generator):
        return self._call(self._inner.collect, model, generator)

    def update(self, batches, generator):
        return self._call(self._inner.update, batches, generator)


class TimedWorkload:
    """The workload ``inner`` (a registry name or ``package.module:Class``, built from ``inner_args``,
    its flags as ``python -m hpcrl.ppo --workload INNER`` takes them), its collect / update timed into
    :data:`PHASES`; everything else is the inner workload's."""

    def __init__(self, inner: str = "cartpole", inner_args: str = "") -> None:
        """``inner_args``: one string, split as a shell would (e.g. ``"--lm.pretrain-steps 50"``)."""
        from hpcrl.ppo.config import parse_args
        from hpcrl.ppo.run import build_workload

        cfg = parse_args(["--workload", inner, *shlex.split(inner_args)])
        cfg.check()
        self._inner, _ = build_workload(cfg)
        self.name = self._inner.name

    def __getattr__(self, name: str) -> Any:  # build_model, publish_tensors, after_publish, default_config
        return getattr(self._inner, name)

    def make_collector(self, rank_seed, device):
        return _Timed(self._inner.make_collector(rank_seed, device), "collect")

    def make_learner(self, model, cfg, grad_average):
        return _Timed(self._inner.make_learner(model, cfg, grad_average), "update")


# -- inside the ranks ---------------------------------------------------------------------------------

class Capture:
    """The events callback of one run on one rank (a module-level class: picklable)."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)  # list.append is atomic: the publisher thread calls it too


def _run_ppo(cfg) -> dict[str, Any]:
    from hpcrl.ppo import train

    PHASES.clear()
    capture = Capture()
    c0, t0 = time.process_time(), time.time()
    out = train(cfg, events=capture)
    return {"out": out, "events": capture.events, "phases": list(PHASES), "t0": t0, "t1": time.time(),
            "cpu_s": time.process_time() - c0}


def _run_single(cfg) -> dict[str, Any]:
    """hpcrl.ppo.sync's loop (SyncPPO.step = collect + update) on the very workload the detached runs use."""
    from hpcrl.ppo.run import build_workload
    from hpcrl.ppo.sync import SyncPPO

    workload, ppo = build_workload(cfg)
    PHASES.clear()
    run = SyncPPO(workload, ppo, cfg.seed, "cpu")
    rows = []
    for _ in range(cfg.total_steps):
        rows.append((time.time(), run.step()["env_steps"]))
    k0, (t_lo, t_hi) = _window(rows)
    return {"env_steps_per_s": (rows[-1][1] - rows[k0][1]) / (t_hi - t_lo),
            "ms_per_step": 1e3 * (t_hi - t_lo) / (len(rows) - k0 - 1), **_phase_ms([list(PHASES)], t_lo, t_hi),
            "steps_total": len(rows), "steps_window": len(rows) - k0 - 1}


def rank_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run several jobs in one set of ranks; a fresh store namespace per job (see module docstring)."""
    results = []
    for i, job in enumerate(jobs):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(1000 + i)
        if job["kind"] == "ppo":
            results.append(_run_ppo(job["cfg"]))
        else:  # single: rank 0 alone; the others wait in the next job's rendezvous
            results.append(_run_single(job["cfg"]) if os.environ.get("RANK") == "0" else None)
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


def _window(rows: list[tuple[float, Any]]) -> tuple[int, tuple[float, float]]:
    """The steady window: from the row after the first 15 % of steps (>= 2) to the last."""
    k0 = max(2, round(0.15 * len(rows)))
    return k0, (rows[k0][0], rows[-1][0])


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def _phase_ms(per_rank: list[list[tuple]], lo: float, hi: float) -> dict[str, float]:
    """Median wall / cpu ms of each phase that ended inside the window, over all ranks."""
    phases: dict[str, list[tuple[float, float]]] = {}
    for rank in per_rank:
        for name, t, wall, cpu in rank:
            if lo <= t <= hi:
                phases.setdefault(name, []).append((wall, cpu))
    return {f"{name}_{kind}_ms": 1e3 * statistics.median(x[j] for x in v)
            for name, v in phases.items() for j, kind in ((0, "wall"), (1, "cpu"))}


def analyse_detached(results: list[dict[str, Any]], trainers: int = 1) -> dict[str, Any]:
    from hpcrl.ppo.events import BatchReceived, RolloutDone, RowLogged, WeightsPublished

    main, makers = results[0], results[trainers:]
    events = main["events"]
    rows = [(e.time, e.row) for e in events if isinstance(e, RowLogged) and e.trainer == 0]
    k0, (t_lo, t_hi) = _window(rows)
    window = t_hi - t_lo
    steps = rows[k0 + 1:]
    dts = [rows[i][0] - rows[i - 1][0] for i in range(k0 + 1, len(rows))]
    maker_idle = [_overlap([(e.wait_start, e.collect_start) for e in m["events"] if isinstance(e, RolloutDone)],
                           t_lo, t_hi) / window for m in makers]
    lags = Counter(e.lag for e in events if isinstance(e, BatchReceived) and not e.stale and t_lo < e.time <= t_hi)
    publish = [e.seconds for e in events if isinstance(e, WeightsPublished) and t_lo < e.time <= t_hi]
    final = main["out"]  # trainer 0's final row: the run's accounting
    return {
        "env_steps_per_s": (rows[-1][1]["env_steps"] - rows[k0][1]["env_steps"]) / window,
        "ms_per_step": 1e3 * window / len(steps),
        "trainer_idle": sum(r["trainer_idle_frac"] * dt for (_, r), dt in zip(steps, dts)) / window,
        "maker_idle": statistics.mean(maker_idle),
        "maker_idle_each": maker_idle,
        # the trainers' own figure (maker_idle_frac): the same intervals, per batch instead of per window
        "maker_idle_logged": statistics.mean(r["maker_idle_frac"] for _, r in steps),
        "lag_mean": statistics.mean(r["lag_mean"] for _, r in steps),
        "lag_max": max(r["lag_max"] for _, r in steps),
        "lag_hist": {str(k): lags[k] for k in sorted(lags)},
        "publish_ms": 1e3 * statistics.median(publish) if publish else float("nan"),
        "publish_mib": next((e.nbytes / MiB for e in events if isinstance(e, WeightsPublished)), None),
        **_phase_ms([r["phases"] for r in results], t_lo, t_hi),
        "steps_total": len(rows), "steps_window": len(steps), "window_s": window,
        "run_s": main["t1"] - main["t0"],
        "cpu_s_per_rank": [round(r["cpu_s"], 2) for r in results],
        **{k: final.get(k) for k in ("samples_produced", "samples_consumed", "dropped_stale", "dropped_shutdown")},
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of every numeric field (the repeats themselves are kept)."""
    out: dict[str, Any] = {"repeats": len(runs), "runs": runs}
    for key in ("env_steps_per_s", "ms_per_step", "trainer_idle", "maker_idle", "lag_mean", "publish_ms",
                "collect_wall_ms", "collect_cpu_ms", "update_wall_ms", "update_cpu_ms"):
        vals = [r[key] for r in runs if key in r and r[key] is not None and math.isfinite(r[key])]
        if vals:
            out[key] = statistics.median(vals)
    if runs and "lag_max" in runs[0]:
        out["lag_max"] = max(r["lag_max"] for r in runs)
        hist = sum((Counter(r["lag_hist"]) for r in runs), Counter())
        out["lag_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        out["dropped_stale"] = sum(r["dropped_stale"] or 0 for r in runs)
        out["accounting_ok"] = all(
            r["samples_produced"] == r["samples_consumed"] + r["dropped_stale"] + r["dropped_shutdown"] for r in runs)
    return out


# -- plan -------------------------------------------------------------------------------------------

def detached_cfg(inner: str, makers: int, lag: int, steps: int, run_dir: str, inner_args: str = ""):
    """``inner_args``: the inner workload's flags, one shell-style string (see :class:`TimedWorkload`)."""
    from hpcrl.ppo.config import DetachedConfig

    return DetachedConfig(workload="ppo_throughput:TimedWorkload", makers=makers, trainers=1, lag=lag,
                          total_steps=steps, run_dir=run_dir,
                          plugin_args=("--inner", inner, f"--inner-args={inner_args}"),  # "=": FLAGS start with --
                          timeout_s=90.0, heartbeat_timeout_s=20.0, checkpoint_every=0, seed=0)


SLEEP = "ppo_throughput:SleepWorkload"


def plan(quick: bool, lm: bool, tmp: str) -> tuple[dict[int, list[dict]], dict[str, Any]]:
    """Jobs per world size (2: 1 maker : 1 trainer, 3: 2 : 1) and the parameters."""
    p = {
        "rollout_s": 0.04, "train_s": 0.04, "samples": 256,
        "ctrl_steps": 40 if quick else 80, "ctrl_reps": 1 if quick else 2,
        "cartpole_steps": 16 if quick else 40, "cartpole_reps": 1 if quick else 2,
        "lm": lm and not quick, "lm_steps": 16, "lm_reps": 2, "lm_args": "--lm.pretrain-steps 50",
        "insitu_mib": None if quick else 16,
    }
    ctrl = f"--rollout-s {p['rollout_s']} --train-s {p['train_s']} --samples {p['samples']}"
    jobs: dict[int, list[dict]] = {2: [], 3: []}
    counter = iter(range(10**6))

    def add(world: int, key: tuple, inner: str, lag: int, steps: int, args: str | None = None,
            kind: str = "ppo") -> None:
        cfg = detached_cfg(inner, world - 1, lag, steps, os.path.join(tmp, f"run{next(counter)}"), args or "")
        jobs[world].append({"kind": kind, "key": key, "cfg": cfg})

    # interleaved: lag 1, lag 0, (single process on rank 0 while the others wait), lag 1, ...
    for world, topo in ((2, "1:1"), (3, "2:1")):
        for name, inner, steps, reps, args in (
                ("controlled", SLEEP, p["ctrl_steps"], p["ctrl_reps"], ctrl),
                ("cartpole", "cartpole", p["cartpole_steps"], p["cartpole_reps"], None),
                ("lm", "lm", p["lm_steps"], p["lm_reps"] if p["lm"] else 0, p["lm_args"])):
            for _ in range(reps):
                for lag in (1, 0):
                    add(world, (name, topo, lag), inner, lag, steps, args)
                if world == 2:
                    add(world, (name, "single", None), inner, 0, steps, args, kind="single")
    if p["insitu_mib"]:
        add(2, ("controlled_16MiB", "1:1", 1), SLEEP, 1, p["ctrl_steps"] // 2,
            f"{ctrl} --param-mib {p['insitu_mib']}")
    return jobs, p


# -- plot -------------------------------------------------------------------------------------------

CONFIGS = [("single", None, None), ("1:1 lag 0", "1:1", 0), ("1:1 lag 1", "1:1", 1),
           ("2:1 lag 0", "2:1", 0), ("2:1 lag 1", "2:1", 1)]


def _grouped_bars(ax, groups: list[str], series: list[tuple[str, list[float]]], **kw) -> list:
    width = 0.8 / max(1, len(series))
    out = []
    for j, (label, ys) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        out.append(ax.bar(xs, ys, width, label=label, **kw))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    return out


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(14, 9))
    tps = payload["throughput"]
    workloads = [w for w in ("controlled", "cartpole", "lm") if w in tps]
    detached = [lbl for lbl, topo, _ in CONFIGS if topo]

    ax = grid[0, 0]
    series = [(lbl, [tps[w][lbl]["env_steps_per_s"] / tps[w]["single"]["env_steps_per_s"] if lbl in tps[w] else 0.0
                     for w in workloads]) for lbl, _, _ in CONFIGS]
    for bars, (lbl, _, _) in zip(_grouped_bars(ax, workloads, series), CONFIGS):
        for b, w in zip(bars, workloads):
            if lbl in tps[w]:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{tps[w][lbl]['env_steps_per_s']:.0f}",
                        ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylim(0, 1.2 * max(max(ys) for _, ys in series))
    ax.set_ylabel("env-steps/s relative to single process\n(numbers on bars: env-steps/s)")
    ax.set_title("throughput (1 thread/process)")
    ax.legend(fontsize=7)

    ax = grid[0, 1]  # idle fractions
    width = 0.8 / (2 * len(workloads))
    for i, w in enumerate(workloads):
        for j, (role, key, hatch) in enumerate((("trainer", "trainer_idle", ""), ("maker", "maker_idle", "//"))):
            off = (2 * i + j - (2 * len(workloads) - 1) / 2) * width
            ax.bar([k + off for k in range(len(detached))],
                   [100 * tps[w].get(lbl, {}).get(key, 0.0) for lbl in detached], width, hatch=hatch, color=f"C{i}",
                   alpha=0.9 if j == 0 else 0.5, label=f"{w}: {role} idle")
    ax.set_xticks(range(len(detached)))
    ax.set_xticklabels(detached, fontsize=8)
    ax.set_ylabel("% of the steady window")
    ax.set_ylim(0, 125)
    ax.set_title("idle: trainer (waits for experience), maker (RolloutDone wait intervals)", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper center")

    ax = grid[1, 0]
    ctrl = tps["controlled"]
    labels = [lbl for lbl in detached if lbl in ctrl]
    lag_values = sorted({int(k) for lbl in labels for k in ctrl[lbl]["lag_hist"]})
    _grouped_bars(ax, labels, [(f"lag {lag}", [ctrl[lbl]["lag_hist"].get(str(lag), 0)
                                               / max(1, sum(ctrl[lbl]["lag_hist"].values())) for lbl in labels])
                               for lag in lag_values])
    ax.set_ylabel("fraction of consumed batches")
    ax.set_title("lag histogram (controlled workload, BatchReceived in the steady window)")
    ax.legend(fontsize=7)

    ax = grid[1, 1]
    groups = workloads + (["controlled\n16 MiB model"] if "insitu_16MiB" in payload else [])
    rows = [tps[w] for w in workloads] + ([{"1:1 lag 1": payload["insitu_16MiB"]}] if len(groups) > len(workloads)
                                          else [])
    ax.set_prop_cycle(color=plt.rcParams["axes.prop_cycle"].by_key()["color"][1:])  # the colours above
    _grouped_bars(ax, groups, [(lbl, [r.get(lbl, {}).get("publish_ms", 0.0) for r in rows]) for lbl in detached])
    ax.set_yscale("log")
    ax.set_ylabel("ms per version (median)")
    ax.set_title("trainer 0's weight publish (WeightsPublished.seconds); vs size and makers: weight_publish.py",
                 fontsize=9)
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


def _f(s: dict[str, Any], key: str, fmt: str, suffix: str = "") -> str:
    return format(s[key], fmt) + suffix if s.get(key) is not None else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats, no LM, no 16 MiB run (< 2 min)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/ppo_throughput.json")
    ap.add_argument("--png", default=None, help="default: the JSON path with .png")
    ap.add_argument("--no-lm", action="store_true", help="skip the LM workload in the full run")
    ap.add_argument("--wait-load", type=float, default=2.5, help="wait while the 1-min load average is above this")
    ap.add_argument("--wait-max", type=float, default=None,
                    help="longest wait for a quiet machine, s (default 120; quick 15)")
    args = ap.parse_args()
    quick = args.quick
    json_path = Path(args.json or os.path.join(RESULTS, "ppo_throughput.json"))
    png_path = Path(args.png) if args.png else json_path.with_suffix(".png")
    torch.set_num_threads(1)

    import ppo_throughput as bench  # the ranks unpickle bench.rank_worker by this module name
    from hpcrl.comm import spawn

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
        for world in (2, 3):
            t = time.perf_counter()
            print(f"\nspawning {world} ranks ({world - 1} maker(s) : 1 trainer) for {len(jobs[world])} runs ...",
                  flush=True)
            per_rank = spawn(bench.rank_worker, world, args=(jobs[world],), timeout_s=900)
            seconds[f"world{world}"] = time.perf_counter() - t
            for j, job in enumerate(jobs[world]):
                w, topo, lag = job["key"]
                if job["kind"] == "single":
                    res = per_rank[0][j]
                    print(f"  {w:17s} single   : {res['env_steps_per_s']:8.0f} env-steps/s, "
                          f"{res['ms_per_step']:6.1f} ms/step, {_phases(res)}", flush=True)
                else:
                    res = analyse_detached([per_rank[r][j] for r in range(world)])
                    print(f"  {w:17s} {topo} lag {lag}: {res['env_steps_per_s']:8.0f} env-steps/s, "
                          f"{res['ms_per_step']:6.1f} ms/step, trainer idle {fmt_pct(res['trainer_idle'])}, maker "
                          f"idle {fmt_pct(res['maker_idle'])}, lags {res['lag_hist']}, publish "
                          f"{res['publish_ms']:.1f} ms, {_phases(res)}, run {res['run_s']:.1f} s", flush=True)
                raw.setdefault(job["key"], []).append(res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    throughput: dict[str, dict[str, Any]] = {}
    for w in [key[0] for key in raw if key[1] == "single"]:
        tp = {"single": summarise(raw[(w, "single", None)])}
        for label, topo, lag in CONFIGS[1:]:
            if (w, topo, lag) in raw:
                tp[label] = summarise(raw[(w, topo, lag)])
        for topo in ("1:1", "2:1"):
            a, b = raw.get((w, topo, 1), []), raw.get((w, topo, 0), [])
            if a and b:
                ratios = [x["env_steps_per_s"] / y["env_steps_per_s"] for x, y in zip(a, b)]
                tp[f"{topo} lag 1"].update(over_lag0=statistics.median(ratios), over_lag0_each=ratios)
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
    info["loadavg_end"] = loadavg()
    seconds["total"] = time.perf_counter() - t_start
    payload["seconds"] = {k: round(v, 1) for k, v in seconds.items()}

    # tables
    ctrl = throughput["controlled"]
    print_table(f"1. controlled cost (rollout {1e3 * params['rollout_s']:.0f} ms, "
                f"update {1e3 * params['train_s']:.0f} ms, {params['samples']} env steps/batch; median of "
                f"{params['ctrl_reps']} run(s) x {ctrl['1:1 lag 1']['runs'][0]['steps_window']} steady steps)",
                ["config", "env-steps/s", "ms/step", "overhead ms/step", "vs single", "vs lag 0", "trainer idle",
                 "maker idle", "lag mean", "lag max", "lag histogram", "dropped", "publish ms"],
                [[label, f"{s['env_steps_per_s']:.0f}", f"{s['ms_per_step']:.1f}", _f(s, "overhead_ms", ".1f"),
                  f"{s['over_single']:.2f}x", _f(s, "over_lag0", ".2f", "x"), fmt_pct(s.get("trainer_idle")),
                  fmt_pct(s.get("maker_idle")), _f(s, "lag_mean", ".2f"), _f(s, "lag_max", "g"),
                  " ".join(f"{k}:{v}" for k, v in s.get("lag_hist", {}).items()), _f(s, "dropped_stale", "g"),
                  _f(s, "publish_ms", ".2f")]
                 for label, _, _ in CONFIGS if (s := ctrl.get(label))])
    ratio = ctrl["1:1 lag 1"]["over_lag0"]
    print(f"detached 1:1 / its lag 0 = {ratio:.2f}x (each repeat: "
          f"{', '.join(f'{x:.2f}' for x in ctrl['1:1 lag 1']['over_lag0_each'])}); target >= {TARGET_RATIO}x, "
          f"ideal 2x: {'MET' if ratio >= TARGET_RATIO else 'MISSED'}", flush=True)
    rows = [[w, label, f"{s['env_steps_per_s']:.0f}", f"{s['ms_per_step']:.1f}", f"{s['over_single']:.2f}x",
             _f(s, "over_lag0", ".2f", "x"), fmt_pct(s.get("trainer_idle")), fmt_pct(s.get("maker_idle")),
             " ".join(f"{k}:{v}" for k, v in s.get("lag_hist", {}).items()),
             f"{s['collect_wall_ms']:.1f} / {s['collect_cpu_ms']:.1f}",
             f"{s['update_wall_ms']:.1f} / {s['update_cpu_ms']:.1f}",
             f"{100 * (1 - s['update_cpu_ms'] / s['update_wall_ms']):.0f} %", _f(s, "publish_ms", ".2f")]
            for w in ("cartpole", "lm") if w in throughput
            for label, _, _ in CONFIGS if (s := throughput[w].get(label))]
    print_table("2. real workloads (median of repeats; CPU-bound: the processes share 2 cores with other users)",
                ["workload", "config", "env-steps/s", "ms/step", "vs single", "vs lag 0", "trainer idle", "maker idle",
                 "lag histogram", "collect ms wall / cpu", "update ms wall / cpu", "update descheduled", "publish ms"],
                rows)
    print("update descheduled = 1 - cpu / wall of the trainer's update: time the trainer thread waited for a core "
          "(other users' load, or our own maker on the second core); large values make that row's comparison unfair.")
    if "insitu_16MiB" in payload:
        s, base = payload["insitu_16MiB"], ctrl["1:1 lag 1"]
        print(f"3. controlled 1:1 lag 1 with a 16 MiB model: {s['env_steps_per_s']:.0f} env-steps/s "
              f"({s['env_steps_per_s'] / base['env_steps_per_s']:.2f}x the tiny-model run), publish "
              f"{s.get('publish_ms', float('nan')):.1f} ms per version (tiny model: "
              f"{base.get('publish_ms', float('nan')):.2f} ms), "
              f"trainer idle {fmt_pct(s.get('trainer_idle'))}, maker idle {fmt_pct(s.get('maker_idle'))}, "
              f"lags {s.get('lag_hist')}")
    print("publish vs size and makers, broadcast vs point-to-point: python benchmarks/ppo/weight_publish.py")

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
