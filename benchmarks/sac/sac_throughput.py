#!/usr/bin/env python
"""FastSAC throughput: hpcrl vs a CleanRL-style eager single-file SAC, and data-parallel overhead.

    python benchmarks/sac/sac_throughput.py [--quick] [--curve | --no-curve] [--json PATH] [--png PATH]
                                        [--wait-load L] [--wait-max S]

One torch thread per process, CPU. Baseline: benchmarks/sac/cleanrl_style_sac.py, the same networks, batch,
losses and schedule as hpcrl.sac.FastSAC, checked first ("equivalence": one update from the same
parameters, batch and noise gives the same losses and parameters). hpcrl is driven through its public
names only: ``hpcrl.sac.FastSAC`` / ``UpdateNoise``, ``hpcrl.replay.ReplayShard``, ``hpcrl.sac.train``
with its events hook (:mod:`hpcrl.sac.events`), and ``python -m hpcrl.sac``.

a. Learner: updates/s of (ReplayShard.sample + UpdateNoise.draw + FastSAC.update) vs the baseline's
   (ReplayBuffer.sample + update), at the pendulum preset sizes and (full run) holosoma's sizes with batch
   256 and G1-like dims (obs 100, action 29). One timed call = policy_frequency updates; repeats of
   both interleaved (benchmarks/common/timing.py). Replays hold 8 envs x 1024 random transitions.
b. Full loop: env-steps/s of ``hpcrl.sac.train`` on Pendulum (pendulum preset: 8 envs, 4 updates per
   env step, batch 256; the ``sps`` of its metrics rows once every step learns) vs the same loop written
   CleanRL style (cleanrl_style_sac.CleanRLStyleLoop), timed over windows of the same length; runs of
   the two alternate.
c. Data parallel: per-update time at W=1 and W=2 ranks (gloo, hpcrl.comm.spawn), fixed per-rank batch
   256, pendulum sizes: ``hpcrl.sac.train`` with --grad-average flat / view / ddp, timed by its
   ``UpdatesDone`` events (per env step the slowest rank's), and the baseline's holosoma-style all-reduce
   timed in blocks of updates. DP overhead = t(W=2) / t(W=1) - 1, from the medians and from the fastest
   (least disturbed) steps. W=2 on 2 cores leaves no core for anything else: the worst case.
d. Learning curve: ``python -m hpcrl.sac --preset pendulum --nproc {1,2}``, episode return vs env steps
   from each run's metrics.jsonl, to a PNG next to the JSON. Skipped under --quick unless --curve.

Targets: learner >= 1.5x the baseline; DP overhead at W=2 <= 10 %; view <= ddp time. --wait-load L
waits before each section until the 1-min load average is below L; the JSON records, per section, the
load and how many cores other processes kept busy. --quick: fewer and shorter repeats, pendulum sizes
only, no curve; JSON defaults to benchmarks/results/sac_throughput_quick.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # cleanrl_style_sac
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: benchmarks.common, hpcrl
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import Quiet, loadavg, machine_info, measure_group, print_table, write_json  # noqa: E402
from cleanrl_style_sac import CleanRLStyleLoop, CleanRLStyleSAC, ReplayBuffer, ReplayBufferSamples  # noqa: E402

from hpcrl.comm import Plane, spawn  # noqa: E402
from hpcrl.envs import Pendulum  # noqa: E402
from hpcrl.replay import ReplayShard  # noqa: E402
from hpcrl.sac import FastSAC, SACConfig, UpdateNoise, preset, train  # noqa: E402
from hpcrl.sac.events import RowLogged, UpdatesDone  # noqa: E402

CPU = torch.device("cpu")
FILL_ENVS, FILL_SLOTS = 8, 1024
TARGET_RATIO, TARGET_DP_OVERHEAD = 1.5, 0.10
DP_MODES = ("flat", "view", "ddp", "cleanrl_style")


# -- a. the learner, and the equivalence check --------------------------------------------------------

def learner_config(name: str, batch: int) -> tuple[SACConfig, int, int]:
    """(config, obs_dim, action_dim) of a learner-size case; holosoma's G1-like dims: docs/holosoma.md."""
    return (preset("pendulum", batch_size=batch), 3, 1) if name == "pendulum" else \
        (preset("holosoma", batch_size=batch), 100, 29)


def filled_replays(obs_dim: int, act_dim: int, seed: int, gamma: float) -> tuple[ReplayShard, ReplayBuffer]:
    """An hpcrl ReplayShard and a CleanRL-style ReplayBuffer holding the same random transitions."""
    g = torch.Generator().manual_seed(seed)
    shard = ReplayShard(FILL_ENVS, FILL_SLOTS, obs_dim, act_dim, 1, gamma)
    rb = ReplayBuffer(FILL_SLOTS, FILL_ENVS, obs_dim, act_dim, seed=seed)
    obs = torch.randn(FILL_ENVS, obs_dim, generator=g)
    for _ in range(FILL_SLOTS):
        action = torch.rand(FILL_ENVS, act_dim, generator=g) * 2 - 1
        reward = -torch.rand(FILL_ENVS, generator=g)
        next_obs = torch.randn(FILL_ENVS, obs_dim, generator=g)
        term = torch.rand(FILL_ENVS, generator=g) < 0.01
        trunc = (torch.rand(FILL_ENVS, generator=g) < 0.005) & ~term
        shard.add(obs, action, reward, next_obs, term, trunc)
        rb.add(obs.numpy(), next_obs.numpy(), action.numpy(), reward.numpy(), term.numpy())
        obs = torch.where((term | trunc)[:, None], torch.randn(FILL_ENVS, obs_dim, generator=g), next_obs)
    return shard, rb


def make_pair(cfg: SACConfig, obs_dim: int, act_dim: int, seed: int = 0) -> tuple[FastSAC, CleanRLStyleSAC]:
    low, high = -torch.ones(act_dim), torch.ones(act_dim)
    torch.manual_seed(seed)
    agent = FastSAC(cfg, obs_dim, act_dim, low, high, CPU, plane=Plane.local("device"))
    base = CleanRLStyleSAC(cfg, obs_dim, act_dim, low, high)
    base.load_from_hpcrl(agent)  # same starting point (speed does not depend on it; the check does)
    return agent, base


def cycles(agent: FastSAC, base: CleanRLStyleSAC, shard: ReplayShard, rb: ReplayBuffer,
           batch: int) -> dict[str, Callable[[], None]]:
    """One call = one policy cycle (policy_frequency updates) of each."""
    pf, gen = agent.cfg.policy_frequency, torch.Generator().manual_seed(0)

    def hpcrl() -> None:
        for _ in range(pf):
            agent.update(shard.sample(batch, gen), UpdateNoise.draw(batch, agent.action_dim, gen, CPU))

    def baseline() -> None:
        for _ in range(pf):
            base.update(rb.sample(batch))
    return {"hpcrl": hpcrl, "cleanrl_style": baseline}


def equivalence_check() -> dict[str, Any]:
    """Same parameters, batches and noise -> same losses and parameters after 2 policy cycles."""
    cfg, obs_dim, act_dim = learner_config("pendulum", 256)
    agent, base = make_pair(cfg, obs_dim, act_dim, seed=1)
    with torch.no_grad():  # non-zero actor heads, so that the actor output and its loss matter
        for p in (*agent.actor.mean.parameters(), *agent.actor.log_std.parameters()):
            p.normal_(0, 0.1)
    base.load_from_hpcrl(agent)
    shard, _ = filled_replays(obs_dim, act_dim, seed=2, gamma=cfg.gamma)
    g = torch.Generator().manual_seed(3)
    worst = {"critic_loss": 0.0, "alpha_loss": 0.0, "actor_loss": 0.0}
    first = {}
    for _ in range(2 * cfg.policy_frequency):
        b = shard.sample(cfg.batch_size, g)
        noise = UpdateNoise.draw(cfg.batch_size, act_dim, g, CPU)
        data = ReplayBufferSamples(b.obs, b.action, b.next_obs, (b.discount == 0).float(), b.reward)
        o1, o2 = agent.update(b, noise), base.update(data, (noise.next_eps, noise.actor_eps))
        for k in o2:
            x, y = float(o1[k]), float(o2[k])
            worst[k] = max(worst[k], abs(x - y) / max(abs(x), 1e-12))
            first.setdefault(k, [x, y])
    pairs = [(agent.actor, base.actor), (agent.critic, base.qnet), (agent.critic_target, base.qnet_target)]
    param_diff = max((p - q).abs().max().item() for a, b in pairs for p, q in zip(a.parameters(), b.parameters()))
    alpha_diff = abs(agent.log_alpha.item() - base.log_alpha.item())
    return {"ok": max(worst.values()) < 1e-5 and param_diff < 1e-4 and alpha_diff < 1e-6,
            "updates": 2 * cfg.policy_frequency, "max_rel_diff": worst, "max_param_diff": param_diff,
            "log_alpha_diff": alpha_diff, "first_losses_hpcrl_vs_baseline": first,
            "tolerance": "rel 1e-5 on losses, 1e-4 abs on parameters, 1e-6 on log_alpha"}


def bench_learner(name: str, batch: int, repeats: int, min_repeat_s: float) -> dict[str, Any]:
    cfg, obs_dim, act_dim = learner_config(name, batch)
    agent, base = make_pair(cfg, obs_dim, act_dim)
    shard, rb = filled_replays(obs_dim, act_dim, seed=0, gamma=cfg.gamma)
    pf = cfg.policy_frequency
    res = measure_group(cycles(agent, base, shard, rb, batch), warmup=2, repeats=repeats, min_repeat_s=min_repeat_s)
    out: dict[str, Any] = {"case": name, "batch": batch, "obs_dim": obs_dim, "action_dim": act_dim,
                           "actor_hidden": cfg.actor_hidden, "critic_hidden": cfg.critic_hidden,
                           "num_atoms": cfg.num_atoms, "policy_frequency": pf}
    for key, r in res.items():
        out[key] = {"updates_per_s": pf / r["median_s"], "updates_per_s_min": pf / r["max_s"],
                    "updates_per_s_max": pf / r["min_s"], "cpu_ms_per_update": 1e3 * r["cpu_median_s"] / pf,
                    "cpu_frac": r["cpu_frac"], "repeats": r["repeats"]}
    out["ratio_wall"] = out["hpcrl"]["updates_per_s"] / out["cleanrl_style"]["updates_per_s"]
    out["ratio_cpu"] = out["cleanrl_style"]["cpu_ms_per_update"] / out["hpcrl"]["cpu_ms_per_update"]
    return out


# -- b. the full loop, c. data parallel: hpcrl.sac.train and its events ---------------------------------

@dataclasses.dataclass
class Recorder:
    """An events callback keeping what the benchmark reads (picklable: it travels to spawned ranks)."""

    rates: list[float] = dataclasses.field(default_factory=list)  # env-steps/s of each metrics row
    updates: dict[int, float] = dataclasses.field(default_factory=dict)  # env step -> seconds per update

    def __call__(self, event: Any) -> None:
        if isinstance(event, RowLogged):
            self.rates.append(event.row["sps"])
        elif isinstance(event, UpdatesDone):
            self.updates[event.vector_step] = event.seconds / event.updates


def loop_config(steps: int, **over: Any) -> SACConfig:
    """The pendulum preset for ``steps`` learning env steps after its warm-up; no evals, no checkpoints."""
    c = preset("pendulum", device="cpu", eval_episodes=0, checkpoint_every=0, **over)
    warm = max(c.learning_starts, c.random_steps)
    return dataclasses.replace(c, total_env_steps=(warm + steps) * c.num_envs)


def train_and_record(cfg: SACConfig) -> Recorder:
    """One rank of ``hpcrl.sac.train`` (run dir: a fresh temporary one per run)."""
    rec = Recorder()
    train(cfg, events=rec)
    return rec


def bench_loop(rounds: int, windows: int) -> dict[str, Any]:
    cfg = loop_config(0)
    window = cfg.log_every
    warm = max(cfg.learning_starts, cfg.random_steps)
    rates: dict[str, list[float]] = {"hpcrl": [], "cleanrl_style": []}
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="sac-loop-") as tmp:
            # warm + one discarded row: the rows after it are steps that all learn
            c = loop_config(window * (windows + 1) - warm % window, run_dir=tmp, seed=r)
            rates["hpcrl"] += train_and_record(c).rates[warm // window + 1:]
        loop = CleanRLStyleLoop(cfg, Pendulum(cfg.num_envs, CPU, seed=r), seed=r)
        for _ in range(warm + window):
            loop.step()
        for _ in range(windows):
            t0 = time.perf_counter()
            for _ in range(window):
                loop.step()
            rates["cleanrl_style"].append(window * cfg.num_envs / (time.perf_counter() - t0))
    out: dict[str, Any] = {"num_envs": cfg.num_envs, "num_updates": cfg.num_updates, "batch": cfg.batch_size,
                           "window_steps": window}
    for key, xs in rates.items():
        out[key] = {"env_steps_per_s": statistics.median(xs), "env_steps_per_s_min": min(xs),
                    "env_steps_per_s_max": max(xs), "windows": len(xs)}
    out["ratio_wall"] = out["hpcrl"]["env_steps_per_s"] / out["cleanrl_style"]["env_steps_per_s"]
    return out


def baseline_dp_rank(batch: int, steps: int) -> dict[int, float]:
    """One rank of the baseline with holosoma's all-reduce: seconds per update of blocks of 4 updates."""
    import cleanrl_style_sac

    from hpcrl.comm import barrier, init_distributed, shutdown

    ctx = init_distributed(timeout_s=300)
    cleanrl_style_sac.GROUP = ctx.device_plane.group
    cfg, obs_dim, act_dim = learner_config("pendulum", batch * ctx.world_size)
    _, rb = filled_replays(obs_dim, act_dim, seed=10 + ctx.rank, gamma=cfg.gamma)
    base = make_pair(cfg, obs_dim, act_dim)[1]
    out = {}
    for step in range(steps):
        barrier(ctx, "block")
        t0 = time.perf_counter()
        for _ in range(4):
            base.update(rb.sample(batch))
        out[step] = (time.perf_counter() - t0) / 4
    shutdown()
    return out


def bench_dp(batch: int, steps: int, skip: int) -> dict[str, Any]:
    out: dict[str, Any] = {"per_rank_batch": batch, "sizes": "pendulum preset (hidden 128, 101 atoms, 2 heads)",
                           "steps": steps}
    for world in (1, 2):
        per_mode = {}
        for mode in DP_MODES:
            if mode == "cleanrl_style":
                ranks = spawn(baseline_dp_rank, world, args=(batch, steps + skip), timeout_s=900)
            else:
                with tempfile.TemporaryDirectory(prefix="sac-dp-") as tmp:
                    cfg = loop_config(steps + skip, batch_size=batch * world, grad_average=mode, run_dir=tmp)
                    ranks = [r.updates for r in spawn(train_and_record, world, args=(cfg,), timeout_s=900)]
            steps_seen = sorted(ranks[0])[skip:]
            slowest = [max(r[s] for r in ranks) for s in steps_seen]  # per step, the slowest rank's
            per_mode[mode] = {"ms_per_update": 1e3 * statistics.median(slowest), "ms_min": 1e3 * min(slowest),
                              "ms_max": 1e3 * max(slowest)}
        out[f"W{world}"] = per_mode
    out["overhead"] = {m: out["W2"][m]["ms_per_update"] / out["W1"][m]["ms_per_update"] - 1 for m in DP_MODES}
    # the least-disturbed step of each: close to what a quiet machine gives when other processes come and go
    out["overhead_min"] = {m: out["W2"][m]["ms_min"] / out["W1"][m]["ms_min"] - 1 for m in DP_MODES}
    out["view_over_ddp_W2"] = out["W2"]["view"]["ms_per_update"] / out["W2"]["ddp"]["ms_per_update"]
    return out


# -- d. the learning curve: python -m hpcrl.sac ---------------------------------------------------------

def run_curve(nproc: int, run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hpcrl.sac", "--preset", "pendulum", "--nproc", str(nproc), "--run-dir",
           str(run_dir), "--checkpoint-every", "0"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Rows without a finished episode carry no return; Pendulum episodes are 200 vector steps.
    points = sorted({r["env_steps"]: r["episode_return"] for r in rows if "eval_return" not in r
                     and isinstance(r.get("episode_return"), (int, float)) and r["episode_return"] != 0.0}.items())
    evals = [r["eval_return"] for r in rows if "eval_return" in r]
    last = [y for _, y in points[-2:]]  # the last two episodes of every env
    return {"nproc": nproc, "command": " ".join(cmd[1:]), "seconds": round(time.perf_counter() - t0, 1),
            "env_steps": [p[0] for p in points], "episode_return": [round(p[1], 2) for p in points],
            "last2_points_mean_return": round(statistics.mean(last), 2) if last else None,
            "eval_return": round(evals[-1], 2) if evals else None,
            "sps_median": statistics.median([r["sps"] for r in rows if "sps" in r] or [math.nan])}


def plot_curves(curves: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in curves:
        line, = ax.plot(c["env_steps"], c["episode_return"], marker="o",
                        label=f"{c['nproc']} rank(s) ({c['seconds']:.0f} s, eval {c['eval_return']})")
        if c["eval_return"] is not None and c["env_steps"]:
            ax.plot([c["env_steps"][-1]], [c["eval_return"]], marker="*", ms=12, color=line.get_color(), ls="")
    ax.axhline(-300, color="gray", ls="--", lw=0.8, label="-300 (solved)")
    ax.set(xlabel="env steps (global)", ylabel="mean episode return (training episodes; * = final eval)")
    ax.set_title("hpcrl FastSAC on Pendulum, python -m hpcrl.sac --preset pendulum\n"
                 "(8 envs and batch 256 global, 4 updates per env step, 1 thread per rank)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------

def summary(learner: list[dict], loop: dict, dp: dict) -> dict[str, Any]:
    """Flat numbers (benchmarks/__main__.py turns them into figures; names with "time" = lower is better)."""
    out: dict[str, Any] = {}
    for r in learner:
        out[f"learner_ratio_{r['case']}"] = round(r["ratio_wall"], 3)
        out[f"learner_ratio_{r['case']}_cpu"] = round(r["ratio_cpu"], 3)
        out[f"learner_throughput_hpcrl_{r['case']}"] = round(r["hpcrl"]["updates_per_s"], 2)
        out[f"learner_throughput_baseline_{r['case']}"] = round(r["cleanrl_style"]["updates_per_s"], 2)
    out["loop_ratio"] = round(loop["ratio_wall"], 3)
    out["loop_throughput_hpcrl"] = round(loop["hpcrl"]["env_steps_per_s"], 1)
    out["loop_throughput_baseline"] = round(loop["cleanrl_style"]["env_steps_per_s"], 1)
    for m in DP_MODES:
        out[f"dp_overhead_time_{m}"] = round(dp["overhead"][m], 4)
        out[f"dp_overhead_min_time_{m}"] = round(dp["overhead_min"][m], 4)
    out["dp_view_over_ddp_time"] = round(dp["view_over_ddp_W2"], 4)
    out["learner_target_met"] = learner[0]["ratio_wall"] >= TARGET_RATIO
    out["dp_overhead_target_met"] = all(dp["overhead"][m] <= TARGET_DP_OVERHEAD for m in ("flat", "view", "ddp"))
    out["view_le_ddp"] = dp["view_over_ddp_W2"] <= 1.0
    return out


def print_tables(eq: dict, learner: list[dict], loop: dict, dp: dict) -> None:
    print(f"\nequivalence (same params/batch/noise, {eq['updates']} updates): {'OK' if eq['ok'] else 'MISMATCH'}; "
          f"max rel loss diff {max(eq['max_rel_diff'].values()):.2e}, max param diff {eq['max_param_diff']:.2e}")
    rate = lambda d, k: f"{d[k]:.1f} ({d[k + '_min']:.0f}-{d[k + '_max']:.0f})"  # noqa: E731
    print_table("a. learner updates/s (1 thread; sample + update; median of interleaved repeats)",
                ["sizes", "batch", "hpcrl upd/s", "baseline upd/s", "ratio", "ratio (cpu time)", "target"],
                [[f"{r['case']} (H {r['actor_hidden']}/{r['critic_hidden']})", r["batch"],
                  rate(r["hpcrl"], "updates_per_s"), rate(r["cleanrl_style"], "updates_per_s"),
                  f"{r['ratio_wall']:.2f}x", f"{r['ratio_cpu']:.2f}x", f">= {TARGET_RATIO}x"] for r in learner])
    print_table(f"b. full loop env-steps/s (Pendulum, {loop['num_envs']} envs, {loop['num_updates']} updates/step, "
                f"batch {loop['batch']}; median of {loop['hpcrl']['windows']} windows)", ["loop", "env-steps/s"],
                [[k, rate(loop[k], "env_steps_per_s")] for k in ("hpcrl", "cleanrl_style")]
                + [["ratio", f"{loop['ratio_wall']:.2f}x"]])
    print_table(f"c. data parallel, gloo, per-rank batch {dp['per_rank_batch']}, ms per update (median over "
                f"{dp['steps']} env steps, slowest rank)",
                ["grad averaging", "W=1 ms", "W=2 ms", "DP overhead", "W=1 min", "W=2 min", "overhead (min)", "target"],
                [[m, f"{dp['W1'][m]['ms_per_update']:.2f}", f"{dp['W2'][m]['ms_per_update']:.2f}",
                  f"{100 * dp['overhead'][m]:+.1f} %", f"{dp['W1'][m]['ms_min']:.2f}", f"{dp['W2'][m]['ms_min']:.2f}",
                  f"{100 * dp['overhead_min'][m]:+.1f} %",
                  f"<= {100 * TARGET_DP_OVERHEAD:.0f} %" if m != "cleanrl_style" else "(baseline)"] for m in DP_MODES])
    print(f"view / ddp time at W=2: {dp['view_over_ddp_W2']:.3f} (target <= 1)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, pendulum sizes only, no curve")
    ap.add_argument("--curve", dest="curve", action="store_true", default=None, help="run the learning curve")
    ap.add_argument("--no-curve", dest="curve", action="store_false")
    ap.add_argument("--json", default=None,
                    help="default benchmarks/results/sac_throughput.json (sac_throughput_quick.json with --quick)")
    ap.add_argument("--png", default=None, help="learning-curve PNG (default: next to the JSON, *_curve.png)")
    ap.add_argument("--wait-load", type=float, default=0.0, help="wait until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=900.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    json_path = Path(args.json or os.path.join(RESULTS, f"sac_throughput{'_quick' if quick else ''}.json"))
    png_path = Path(args.png) if args.png else json_path.with_name(json_path.stem + "_curve.png")
    info = machine_info(CPU, torch.get_num_threads())
    quiet = Quiet(args.wait_load, args.wait_max)
    print(f"sac_throughput: {info['cpu_model']}, {info['cpu_count']} cpus, torch {info['torch']}, 1 thread/process, "
          f"load {info['loadavg_start']}" + (" [quick]" if quick else ""), flush=True)
    seconds: dict[str, float] = {}
    quiet.start("equivalence")
    eq = equivalence_check()
    seconds["equivalence"] = quiet.end("equivalence")
    quiet.start("learner")
    learner = [bench_learner("pendulum", 256, *((5, 0.3) if quick else (9, 1.0)))]
    learner += [] if quick else [bench_learner("holosoma", 256, 5, 1.0)]
    seconds["learner"] = quiet.end("learner")
    quiet.start("loop")
    loop = bench_loop(*((2, 2) if quick else (3, 4)))
    seconds["loop"] = quiet.end("loop")
    quiet.start("dp")
    dp = bench_dp(256, *((12, 3) if quick else (40, 5)))
    seconds["dp"] = quiet.end("dp")
    print_tables(eq, learner, loop, dp)
    payload: dict[str, Any] = {"benchmark": "sac_throughput", "quick": quick, "machine": info,
                               "targets": {"learner_ratio": TARGET_RATIO, "dp_overhead": TARGET_DP_OVERHEAD,
                                           "view_le_ddp": True},
                               "equivalence": eq, "learner": learner, "loop": loop, "dp": dp}
    if args.curve if args.curve is not None else not quick:
        quiet.start("curve")
        with tempfile.TemporaryDirectory(prefix="sac-curve-") as tmp:
            curves = [run_curve(nproc, Path(tmp, f"np{nproc}")) for nproc in (1, 2)]
        plot_curves(curves, png_path)
        seconds["curve"] = quiet.end("curve")
        payload["curve"] = {"png": str(png_path), "runs": curves}
        print_table("d. learning curve (python -m hpcrl.sac --preset pendulum)",
                    ["ranks", "wall s", "env-steps/s (metrics sps)", "return, last 2 points", "eval return"],
                    [[c["nproc"], c["seconds"], c["sps_median"], c["last2_points_mean_return"], c["eval_return"]]
                     for c in curves])
        print(f"curve PNG: {png_path}")
    info["loadavg_end"], info["load_per_section"], info["wait_limit"] = loadavg(), quiet.sections, args.wait_load
    payload["seconds"] = {**seconds, "waiting_for_quiet": quiet.waited_s()}
    payload["summary"] = summary(learner, loop, dp)
    write_json(json_path, payload)
    print(f"\nsections (s): {payload['seconds']}; load per section: {quiet.sections}\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
