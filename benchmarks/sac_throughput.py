#!/usr/bin/env python
"""FastSAC throughput: hpcrl vs a CleanRL-style eager single-file SAC, and data-parallel overhead (issue 3).

    python benchmarks/sac_throughput.py [--quick] [--curve | --no-curve] [--json PATH] [--png PATH]
                                        [--wait-load L] [--profile]

Everything runs in ONE invocation with one torch thread per process (torch.set_num_threads(1)).
Baseline: benchmarks/cleanrl_style_sac.py, same networks, batch, losses and schedule as
hpcrl.sac.FastSAC (checked first: one update from the same parameters, batch and noise gives the
same losses and parameters; printed as "equivalence").

a. Learner: updates/s of (hpcrl ReplayShard.sample + UpdateNoise.draw + FastSAC.update) vs
   (CleanRL-style ReplayBuffer.sample + update), at the pendulum preset sizes (actor/critic hidden
   128, 101 atoms, batch 256, policy_frequency 2) and at holosoma's default sizes (hidden 512 / 768,
   101 atoms, policy_frequency 4) with batch 256 instead of 8192 and G1-like dims (obs 100, action 29).
   One timed call = policy_frequency updates (so every call has the same actor/critic mix); repeats
   of both are interleaved (benchmarks/_timing.py). Replays hold 8 envs x 1024 random transitions.
b. Full loop: env-steps/s of env step + replay add + num_updates updates (pendulum preset: 8 envs,
   4 updates per env step, batch 256, obs normalisation on) on hpcrl.envs.Pendulum; the hpcrl loop is
   train.py's inner loop without logging/checkpoints, the baseline loop the same in CleanRL style.
c. Data parallel: per-update time at W=1 and W=2 ranks (gloo, hpcrl.comm.spawn, 1 thread per rank),
   fixed per-rank batch 256, pendulum preset sizes, for GradSync flat / view / ddp and for the
   baseline's holosoma-style all-reduce. Blocks of updates, modes interleaved, a barrier before each
   block; the per-block time is the slowest rank's. DP overhead = t(W=2) / t(W=1) - 1 per mode, from
   the median blocks and from the fastest (least disturbed) blocks; also the bare gloo all-reduce time
   of the update's buffers. W=2 on 2 cores leaves no core for anything else: the worst case.
d. Learning curve: `python -m hpcrl.sac --preset pendulum --nproc {1,2} --checkpoint-every 0`,
   episode return vs env steps read from each run's metrics.jsonl, plotted to a PNG next to the JSON.
   Skipped under --quick unless --curve is given.

Targets (issue 3): learner >= 1.5x the baseline; DP overhead at W=2 <= 10 %; view <= ddp time.
Timings on a shared 2-core machine: "cpu" columns (process CPU time per update) are robust to being
descheduled; wall is what a user sees. --wait-load L waits before each section (all waits together at
most --wait-max s) until the 1-min load average is below L; the JSON records, per section, the load
average and how many cores OTHER processes kept busy (/proc/stat minus our own CPU time).
With --quick (about 1.5 min): fewer repeats, pendulum sizes only, no curve; JSON defaults to
benchmarks/results/sac_throughput_quick.json. Full run: about 7-8 min plus waits.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, HERE)
from _timing import loadavg, machine_info, measure_group, print_table, write_json  # noqa: E402
from cleanrl_style_sac import CleanRLStyleSAC, EmpiricalNormalization, ReplayBuffer, ReplayBufferSamples  # noqa: E402

from hpcrl.envs import EpisodeStats, Pendulum  # noqa: E402
from hpcrl.replay import ReplayShard  # noqa: E402
from hpcrl.sac.agent import FastSAC, UpdateNoise  # noqa: E402
from hpcrl.sac.config import SACConfig, preset  # noqa: E402
from hpcrl.sac.normalizer import ObsNormalizer  # noqa: E402

CPU = torch.device("cpu")
FILL_ENVS, FILL_SLOTS = 8, 1024
TARGET_RATIO, TARGET_DP_OVERHEAD = 1.5, 0.10


# -- shared set-up -----------------------------------------------------------------------------------

def learner_config(name: str, batch: int) -> tuple[SACConfig, int, int]:
    """(config, obs_dim, action_dim) of a learner-size case."""
    if name == "pendulum":
        return preset("pendulum", batch_size=batch), 3, 1
    if name == "holosoma":
        # G1-like dims: docs/holosoma.md#problem-size-of-holosomas-humanoid-tasks
        return preset("holosoma", batch_size=batch), 100, 29
    raise ValueError(name)


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
        done = term | trunc
        obs = torch.where(done[:, None], torch.randn(FILL_ENVS, obs_dim, generator=g), next_obs)
    return shard, rb


def make_pair(cfg: SACConfig, obs_dim: int, act_dim: int, seed: int = 0, plane: Plane | None = None):
    low, high = -torch.ones(act_dim), torch.ones(act_dim)
    torch.manual_seed(seed)
    agent = FastSAC(cfg, obs_dim, act_dim, low, high, CPU, plane=plane or Plane.local("device"))
    torch.manual_seed(seed)
    base = CleanRLStyleSAC(cfg, obs_dim, act_dim, low, high)
    base.load_from_hpcrl(agent)  # same starting point (speed does not depend on it; the check does)
    return agent, base


def hpcrl_cycle(agent: FastSAC, shard: ReplayShard, gen: torch.Generator, batch: int) -> Callable[[], None]:
    pf, act_dim = agent.cfg.policy_frequency, agent.action_dim

    def run() -> None:
        for _ in range(pf):
            agent.update(shard.sample(batch, gen), UpdateNoise.draw(batch, act_dim, gen, CPU))
    return run


def baseline_cycle(base: CleanRLStyleSAC, rb: ReplayBuffer, batch: int) -> Callable[[], None]:
    pf = base.cfg.policy_frequency

    def run() -> None:
        for _ in range(pf):
            base.update(rb.sample(batch))
    return run


# -- equivalence check -------------------------------------------------------------------------------

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
    rows = []
    for _ in range(2 * cfg.policy_frequency):
        b = shard.sample(cfg.batch_size, g)
        noise = UpdateNoise.draw(cfg.batch_size, act_dim, g, CPU)
        data = ReplayBufferSamples(b.obs, b.action, b.next_obs, (b.discount == 0).float(), b.reward)
        o1, o2 = agent.update(b, noise), base.update(data, (noise.next_eps, noise.actor_eps))
        for k in o2:
            x, y = float(o1[k]), float(o2[k])
            worst[k] = max(worst[k], abs(x - y) / max(abs(x), 1e-12))
        rows.append({k: [float(o1[k]), float(o2[k])] for k in o2})
    pairs = [(agent.actor, base.actor), (agent.critic, base.qnet), (agent.critic_target, base.qnet_target)]
    param_diff = max((p - q).abs().max().item() for a, b in pairs for p, q in zip(a.parameters(), b.parameters()))
    alpha_diff = abs(agent.log_alpha.item() - base.log_alpha.item())
    ok = max(worst.values()) < 1e-5 and param_diff < 1e-4 and alpha_diff < 1e-6
    return {"ok": ok, "updates": len(rows), "max_rel_diff": worst, "max_param_diff": param_diff,
            "log_alpha_diff": alpha_diff, "losses_hpcrl_vs_baseline": rows[:2], "tolerance":
            "rel 1e-5 on losses, 1e-4 abs on parameters, 1e-6 on log_alpha"}


# -- a. learner --------------------------------------------------------------------------------------

def bench_learner(name: str, batch: int, repeats: int, min_repeat_s: float) -> dict[str, Any]:
    cfg, obs_dim, act_dim = learner_config(name, batch)
    agent, base = make_pair(cfg, obs_dim, act_dim)
    shard, rb = filled_replays(obs_dim, act_dim, seed=0, gamma=cfg.gamma)
    gen = torch.Generator().manual_seed(0)
    pf = cfg.policy_frequency
    res = measure_group({"hpcrl": hpcrl_cycle(agent, shard, gen, batch), "cleanrl_style": baseline_cycle(base, rb, batch)},
                        warmup=2, repeats=repeats, min_repeat_s=min_repeat_s)
    out: dict[str, Any] = {"case": name, "batch": batch, "obs_dim": obs_dim, "action_dim": act_dim,
                           "actor_hidden": cfg.actor_hidden, "critic_hidden": cfg.critic_hidden,
                           "num_atoms": cfg.num_atoms, "num_q": cfg.num_q, "policy_frequency": pf,
                           "critic_params": sum(p.numel() for p in agent.critic.parameters()),
                           "actor_params": sum(p.numel() for p in agent.actor.parameters())}
    for key, r in res.items():
        out[key] = {"updates_per_s": pf / r["median_s"], "updates_per_s_min": pf / r["max_s"],
                    "updates_per_s_max": pf / r["min_s"], "ms_per_update": 1e3 * r["median_s"] / pf,
                    "cpu_ms_per_update": 1e3 * r["cpu_median_s"] / pf, "cpu_frac": r["cpu_frac"],
                    "calls_per_repeat": r["inner"], "repeats": r["repeats"]}
    out["ratio_wall"] = out["hpcrl"]["updates_per_s"] / out["cleanrl_style"]["updates_per_s"]
    out["ratio_cpu"] = out["cleanrl_style"]["cpu_ms_per_update"] / out["hpcrl"]["cpu_ms_per_update"]
    return out


# -- b. full loop ------------------------------------------------------------------------------------

class HpcrlLoop:
    """train.py's inner loop (normaliser update, act, env step, replay add, episode stats, updates)."""

    def __init__(self, cfg: SACConfig, seed: int = 0):
        self.cfg = cfg
        self.env = Pendulum(cfg.num_envs, CPU, seed=seed)
        torch.manual_seed(seed)
        self.agent = FastSAC(cfg, self.env.obs_dim, self.env.action_dim, self.env.action_low, self.env.action_high, CPU,
                             plane=Plane.local("device"))
        self.norm = ObsNormalizer(self.env.obs_dim, enabled=cfg.obs_normalization)
        self.replay = ReplayShard(cfg.num_envs, cfg.buffer_size, self.env.obs_dim, self.env.action_dim, cfg.n_step,
                                  cfg.gamma, CPU)
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = EpisodeStats(cfg.num_envs, CPU)
        self.obs = self.env.reset(seed=seed)
        self.it = 0

    def step(self) -> None:
        cfg, env = self.cfg, self.env
        self.norm.update(self.obs)
        if self.it < cfg.random_steps:
            low, high = env.action_low, env.action_high
            action = low + (high - low) * torch.rand(cfg.num_envs, env.action_dim, generator=self.gen)
        else:
            action = self.agent.actor.act(self.norm(self.obs), self.gen)
        result = env.step(action)
        self.replay.add(self.obs, action, result.reward * cfg.reward_scale, result.next_obs, result.terminated,
                        result.truncated)
        self.stats.update(result)
        self.obs = result.obs
        if self.it >= cfg.learning_starts:
            for _ in range(cfg.num_updates):
                batch = self.replay.sample(cfg.batch_size, self.gen)
                batch = batch._replace(obs=self.norm(batch.obs), next_obs=self.norm(batch.next_obs))
                self.agent.update(batch, UpdateNoise.draw(cfg.batch_size, env.action_dim, self.gen, CPU))
        self.it += 1


class BaselineLoop:
    """The same loop written CleanRL style: numpy replay, per-env return bookkeeping in numpy."""

    def __init__(self, cfg: SACConfig, seed: int = 0):
        import numpy as np
        self.np, self.cfg = np, cfg
        self.env = Pendulum(cfg.num_envs, CPU, seed=seed)
        torch.manual_seed(seed)
        self.agent = CleanRLStyleSAC(cfg, self.env.obs_dim, self.env.action_dim, self.env.action_low,
                                     self.env.action_high)
        self.norm = EmpiricalNormalization(self.env.obs_dim)
        self.rb = ReplayBuffer(cfg.buffer_size, cfg.num_envs, self.env.obs_dim, self.env.action_dim, seed=seed)
        self.returns = np.zeros(cfg.num_envs, dtype=np.float32)
        self.finished: list[float] = []
        self.obs = self.env.reset(seed=seed)
        self.it = 0

    def step(self) -> None:
        cfg, env, np = self.cfg, self.env, self.np
        self.norm.update(self.obs)
        if self.it < cfg.random_steps:
            low, high = env.action_low, env.action_high
            action = low + (high - low) * torch.rand(cfg.num_envs, env.action_dim)
        else:
            with torch.no_grad():
                action, _ = self.agent.actor.get_action(self.norm(self.obs))
        result = env.step(action)
        reward = result.reward.numpy()
        self.rb.add(self.obs.numpy(), result.next_obs.numpy(), action.numpy(), reward * cfg.reward_scale,
                    result.terminated.numpy())
        self.returns += reward
        done = (result.terminated | result.truncated).numpy()
        if done.any():
            self.finished.extend(self.returns[done].tolist())
            self.returns[done] = 0.0
        self.obs = result.obs
        if self.it >= cfg.learning_starts:
            for _ in range(cfg.num_updates):
                data = self.rb.sample(cfg.batch_size)
                data = data._replace(observations=self.norm(data.observations),
                                     next_observations=self.norm(data.next_observations))
                self.agent.update(data)
        self.it += 1


def bench_loop(repeats: int, min_repeat_s: float) -> dict[str, Any]:
    cfg = preset("pendulum")
    loops = {"hpcrl": HpcrlLoop(cfg), "cleanrl_style": BaselineLoop(cfg)}
    for loop in loops.values():  # past the random phase and learning_starts: every step learns
        for _ in range(max(cfg.learning_starts, cfg.random_steps)):
            loop.step()
    res = measure_group({k: v.step for k, v in loops.items()}, warmup=2, repeats=repeats, min_repeat_s=min_repeat_s)
    out: dict[str, Any] = {"num_envs": cfg.num_envs, "num_updates": cfg.num_updates, "batch": cfg.batch_size,
                           "policy_frequency": cfg.policy_frequency}
    for key, r in res.items():
        out[key] = {"env_steps_per_s": cfg.num_envs / r["median_s"], "env_steps_per_s_min": cfg.num_envs / r["max_s"],
                    "env_steps_per_s_max": cfg.num_envs / r["min_s"],
                    "updates_per_s": cfg.num_updates / r["median_s"],
                    "cpu_env_steps_per_s": cfg.num_envs / r["cpu_median_s"], "cpu_frac": r["cpu_frac"],
                    "ms_per_vector_step": 1e3 * r["median_s"], "calls_per_repeat": r["inner"]}
    out["ratio_wall"] = out["hpcrl"]["env_steps_per_s"] / out["cleanrl_style"]["env_steps_per_s"]
    out["ratio_cpu"] = out["hpcrl"]["cpu_env_steps_per_s"] / out["cleanrl_style"]["cpu_env_steps_per_s"]
    return out


# -- c. data parallel --------------------------------------------------------------------------------

DP_MODES = ("flat", "view", "ddp", "cleanrl_style")


def dp_worker(batch: int, cycles: int, warmup: int, repeats: int) -> dict[str, Any]:
    """One rank: time blocks of `cycles` policy cycles per mode, modes interleaved, same order on all ranks."""
    import warnings

    import torch.distributed as dist

    from hpcrl.comm import init_distributed, shutdown

    # torch 2.13 deprecates DDP's broadcast_buffers (used by GradSync.wrap); keep the tables readable.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)

    ctx = init_distributed(timeout_s=300)
    rank, world = ctx.rank, ctx.world_size
    import cleanrl_style_sac

    cleanrl_style_sac.GROUP = ctx.device_plane.group  # the default group, except under HPCRL_STRICT_PLANES=1
    fns: dict[str, Callable[[], None]] = {}
    gen = torch.Generator().manual_seed(100 + rank)
    cfg, obs_dim, act_dim = learner_config("pendulum", batch * world)
    shard, rb = filled_replays(obs_dim, act_dim, seed=10 + rank, gamma=cfg.gamma)
    for mode in DP_MODES:
        c = preset("pendulum", batch_size=batch * world, grad_sync=mode if mode != "cleanrl_style" else "flat")
        agent, base = make_pair(c, obs_dim, act_dim, plane=ctx.device_plane)  # same init on every rank (same seed)
        fns[mode] = baseline_cycle(base, rb, batch) if mode == "cleanrl_style" else hpcrl_cycle(agent, shard, gen, batch)
    pf = cfg.policy_frequency
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {m: [] for m in fns}
    cpu: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(repeats):
        for mode, fn in fns.items():
            if world > 1:
                dist.barrier(group=ctx.host_plane.group)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(cycles):
                fn()
            t1, c1 = time.perf_counter(), time.process_time()
            wall[mode].append((t1 - t0) / (cycles * pf))
            cpu[mode].append((c1 - c0) / (cycles * pf))
    # The bare collectives of one update: critic + log-alpha (every update) and actor (every pf-th).
    coll: dict[str, float] = {}
    if world > 1:
        for name, numel in (("critic_alpha", sum(p.numel() for p in agent.critic.parameters()) + 1),
                            ("actor", sum(p.numel() for p in agent.actor.parameters()))):
            buf = torch.zeros(numel)
            group = ctx.device_plane.group
            for _ in range(20):
                dist.all_reduce(buf, group=group)
            dist.barrier(group=ctx.host_plane.group)
            t0 = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(buf, group=group)
            coll[name] = (time.perf_counter() - t0) / 200
    shutdown()
    return {"rank": rank, "world": world, "wall": wall, "cpu": cpu, "allreduce_s": coll}


def bench_dp(batch: int, cycles: int, warmup: int, repeats: int) -> dict[str, Any]:
    from hpcrl.comm import spawn

    out: dict[str, Any] = {"per_rank_batch": batch, "sizes": "pendulum preset (hidden 128, 101 atoms, 2 heads)",
                           "cycles_per_block": cycles, "repeats": repeats,
                           "updates_per_block": cycles * preset("pendulum").policy_frequency,
                           "note": "W=2 on a 2-core machine is 2 single-threaded ranks on 2 cores: no spare core "
                                   "for gloo's progress thread or the OS, so this is the worst case."}
    for world in (1, 2):
        t0 = time.perf_counter()
        results = spawn(dp_worker, world, args=(batch, cycles, warmup, repeats), timeout_s=900, num_threads=1)
        per_mode = {}
        for mode in DP_MODES:
            # per block, the slowest rank defines the update time
            wall = [max(r["wall"][mode][i] for r in results) for i in range(repeats)]
            cpu = [max(r["cpu"][mode][i] for r in results) for i in range(repeats)]
            per_mode[mode] = {"ms_per_update": 1e3 * statistics.median(wall), "ms_min": 1e3 * min(wall),
                              "ms_max": 1e3 * max(wall), "cpu_ms_per_update": 1e3 * statistics.median(cpu),
                              "samples_ms": [round(1e3 * w, 4) for w in wall]}
        out[f"W{world}"] = per_mode
        if world > 1:
            coll = {k: max(r["allreduce_s"][k] for r in results) for k in results[0]["allreduce_s"]}
            out["allreduce_us"] = {k: round(1e6 * v, 1) for k, v in coll.items()}
            # the collectives one update needs on average, as a share of the W=1 update time (added later)
            pf = preset("pendulum").policy_frequency
            out["allreduce_us"]["per_update"] = round(1e6 * (coll["critic_alpha"] + coll["actor"] / pf), 1)
        out[f"W{world}_seconds"] = round(time.perf_counter() - t0, 1)
    out["overhead"] = {m: out["W2"][m]["ms_per_update"] / out["W1"][m]["ms_per_update"] - 1 for m in DP_MODES}
    # the least-disturbed block of each: close to what a quiet machine gives when other processes come and go
    out["overhead_min"] = {m: out["W2"][m]["ms_min"] / out["W1"][m]["ms_min"] - 1 for m in DP_MODES}
    out["overhead_cpu"] = {m: out["W2"][m]["cpu_ms_per_update"] / out["W1"][m]["cpu_ms_per_update"] - 1
                           for m in DP_MODES}
    out["view_over_ddp_W2"] = out["W2"]["view"]["ms_per_update"] / out["W2"]["ddp"]["ms_per_update"]
    out["allreduce_share_of_W1_update"] = out["allreduce_us"]["per_update"] / (1e3 * out["W1"]["flat"]["ms_per_update"])
    return out


# -- d. learning curve -------------------------------------------------------------------------------

def run_curve(nproc: int, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hpcrl.sac", "--preset", "pendulum", "--nproc", str(nproc), "--run-dir",
           str(run_dir), "--checkpoint-every", "0", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Rows without a finished episode carry 0 / NaN; the eval row repeats the last row (dedupe by env_steps).
    # Pendulum episodes are 200 vector steps, so with 8 envs (any split) a point comes every 1,600 env steps.
    by_step = {r["env_steps"]: r["episode_return"] for r in rows
               if r.get("episode_return") is not None and not math.isnan(r["episode_return"])
               and r["episode_return"] != 0.0}
    points = sorted(by_step.items())
    evals = [r["eval_return"] for r in rows if "eval_return" in r]
    sps = [r["sps"] for r in rows if "sps" in r]
    last = [y for _, y in points[-2:]]  # the last two episodes of every env
    return {"nproc": nproc, "command": " ".join(cmd[1:]), "seconds": round(seconds, 1),
            "env_steps": [p[0] for p in points], "episode_return": [round(p[1], 2) for p in points],
            "last2_points_mean_return": round(statistics.mean(last), 2) if last else None,
            "eval_return": round(evals[-1], 2) if evals else None,
            "sps_median": statistics.median(sps) if sps else None}


def plot_curves(curves: list[dict[str, Any]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in curves:
        label = f"{c['nproc']} rank{'s' if c['nproc'] > 1 else ''} ({c['seconds']:.0f} s"
        label += f", eval {c['eval_return']:.0f})" if c.get("eval_return") is not None else ")"
        line, = ax.plot(c["env_steps"], c["episode_return"], marker="o", label=label)
        if c.get("eval_return") is not None and c["env_steps"]:
            ax.plot([c["env_steps"][-1]], [c["eval_return"]], marker="*", ms=12, color=line.get_color(), ls="")
    ax.axhline(-300, color="gray", ls="--", lw=0.8, label="-300 (issue 3 bar)")
    ax.set_xlabel("env steps (global)")
    ax.set_ylabel("mean episode return (training episodes; * = final eval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# -- profile -----------------------------------------------------------------------------------------

def profile_learner(name: str, batch: int, cycles: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    cfg, obs_dim, act_dim = learner_config(name, batch)
    agent, base = make_pair(cfg, obs_dim, act_dim)
    shard, rb = filled_replays(obs_dim, act_dim, seed=0, gamma=cfg.gamma)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for key, fn in (("hpcrl", hpcrl_cycle(agent, shard, gen, batch)), ("cleanrl_style", baseline_cycle(base, rb, batch))):
        for _ in range(5):
            fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(cycles):
                fn()
        avgs = prof.key_averages()
        n_updates = cycles * cfg.policy_frequency
        total = sum(a.self_cpu_time_total for a in avgs)
        rows = sorted(avgs, key=lambda a: a.self_cpu_time_total, reverse=True)[:20]
        gemm = sum(a.self_cpu_time_total for a in avgs if a.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))
        out[key] = {"self_cpu_us_per_update": total / n_updates, "gemm_share": gemm / max(total, 1),
                    "ops_per_update": sum(a.count for a in avgs if a.key.startswith("aten::")) / n_updates,
                    "top": [{"op": a.key, "calls_per_update": a.count / n_updates,
                             "self_us_per_update": a.self_cpu_time_total / n_updates,
                             "share": a.self_cpu_time_total / max(total, 1)} for a in rows]}
    return out


# -- main --------------------------------------------------------------------------------------------

class Quiet:
    """Before each section: wait until the 1-min load average is below ``limit`` (0 = never wait), all
    waits together at most ``max_wait`` s; records the load at the start and end of every section."""

    def __init__(self, limit: float, max_wait: float):
        self.limit, self.budget = limit, max_wait
        self.sections: dict[str, dict[str, Any]] = {}

    def start(self, name: str) -> float:
        t0 = time.time()
        while self.limit > 0 and os.getloadavg()[0] >= self.limit and time.time() - t0 < self.budget:
            time.sleep(5)
        waited = time.time() - t0
        self.budget = max(0.0, self.budget - waited)
        self.sections[name] = {"waited_s": round(waited, 1), "load_start": loadavg(), "_cpu0": _cpu_counters()}
        return time.perf_counter()

    def end(self, name: str) -> None:
        sec = self.sections[name]
        sec["load_end"] = loadavg()
        c0, c1 = sec.pop("_cpu0"), _cpu_counters()
        if c0 and c1:
            wall = c1["wall"] - c0["wall"]
            busy = c1["busy"] - c0["busy"]
            ours = c1["ours"] - c0["ours"]
            # cores kept busy by OTHER processes during the section (ours = this process + its joined children)
            sec["other_processes_cores"] = round(max(0.0, busy - ours) / wall, 2)
            sec["our_cores"] = round(ours / wall, 2)


def _cpu_counters() -> dict[str, float] | None:
    """Machine-wide busy CPU seconds (/proc/stat), our own CPU seconds (self + joined children), wall."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / hz  # user nice system idle iowait irq softirq steal
    t = os.times()
    return {"busy": busy, "ours": t.user + t.system + t.children_user + t.children_system, "wall": time.time()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, pendulum sizes only, no curve")
    ap.add_argument("--curve", dest="curve", action="store_true", default=None, help="run the learning curve")
    ap.add_argument("--no-curve", dest="curve", action="store_false")
    ap.add_argument("--json", default=None,
                    help="default benchmarks/results/sac_throughput.json (sac_throughput_quick.json with --quick)")
    ap.add_argument("--png", default=None, help="learning-curve PNG (default: next to the JSON, *_curve.png)")
    ap.add_argument("--profile", action="store_true", help="always profile (else only when the 1.5x target is missed)")
    ap.add_argument("--wait-load", type=float, default=0.0, help="wait until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=900.0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    quick = args.quick
    curve = (not quick) if args.curve is None else args.curve
    json_path = Path(args.json or os.path.join(HERE, "results",
                                               "sac_throughput_quick.json" if quick else "sac_throughput.json"))
    png_path = Path(args.png) if args.png else json_path.with_name(json_path.stem + "_curve.png")

    info = machine_info(CPU, torch.get_num_threads())
    quiet = Quiet(args.wait_load, args.wait_max)
    info["loadavg_before_wait"] = loadavg()
    quiet.start("equivalence")
    info["loadavg_start"] = loadavg()
    payload: dict[str, Any] = {"benchmark": "sac_throughput", "quick": quick, "machine": info,
                               "targets": {"learner_ratio": TARGET_RATIO, "dp_overhead": TARGET_DP_OVERHEAD,
                                           "view_le_ddp": True}}
    seconds: dict[str, float] = {}
    print(f"sac_throughput: {info['cpu_model']}, {info['cpu_count']} cpus, torch {info['torch']}, "
          f"1 thread/process, load {info['loadavg_start']}" + (" [quick]" if quick else ""), flush=True)

    t = time.perf_counter()
    eq = equivalence_check()
    seconds["equivalence"] = time.perf_counter() - t
    quiet.end("equivalence")
    payload["equivalence"] = eq
    print(f"\nequivalence (same params/batch/noise, {eq['updates']} updates): "
          f"{'OK' if eq['ok'] else 'MISMATCH'}; max rel loss diff {max(eq['max_rel_diff'].values()):.2e}, "
          f"max param diff {eq['max_param_diff']:.2e}, first critic loss hpcrl/baseline "
          f"{eq['losses_hpcrl_vs_baseline'][0]['critic_loss'][0]:.6f} / "
          f"{eq['losses_hpcrl_vs_baseline'][0]['critic_loss'][1]:.6f}", flush=True)

    # a. learner
    t = quiet.start("learner")
    cases = [("pendulum", 256)] + ([] if quick else [("holosoma", 256)])
    learner = []
    for name, batch in cases:
        rep, mrs = (5, 0.3) if quick else (9, 1.0)
        if name == "holosoma":
            rep, mrs = 5, 1.0
        learner.append(bench_learner(name, batch, rep, mrs))
    seconds["learner"] = time.perf_counter() - t
    quiet.end("learner")
    payload["learner"] = learner
    print_table("a. learner updates/s (1 thread; sample + update; median of interleaved repeats)",
                ["sizes", "batch", "hpcrl upd/s", "baseline upd/s", "ratio", "ratio (cpu time)", "target"],
                [[f"{r['case']} (H {r['actor_hidden']}/{r['critic_hidden']})", r["batch"],
                  f"{r['hpcrl']['updates_per_s']:.1f} ({r['hpcrl']['updates_per_s_min']:.0f}-{r['hpcrl']['updates_per_s_max']:.0f})",
                  f"{r['cleanrl_style']['updates_per_s']:.1f} ({r['cleanrl_style']['updates_per_s_min']:.0f}-"
                  f"{r['cleanrl_style']['updates_per_s_max']:.0f})",
                  f"{r['ratio_wall']:.2f}x", f"{r['ratio_cpu']:.2f}x", f">= {TARGET_RATIO}x"] for r in learner])

    # b. full loop
    t = quiet.start("loop")
    loop = bench_loop(*((5, 0.3) if quick else (9, 1.0)))
    seconds["loop"] = time.perf_counter() - t
    quiet.end("loop")
    payload["loop"] = loop
    print_table(f"b. full loop env-steps/s (Pendulum, {loop['num_envs']} envs, {loop['num_updates']} updates/step, "
                f"batch {loop['batch']})",
                ["learner", "env-steps/s", "updates/s", "ms / vector step", "env-steps/s (cpu time)"],
                [[k, f"{loop[k]['env_steps_per_s']:.0f} ({loop[k]['env_steps_per_s_min']:.0f}-"
                     f"{loop[k]['env_steps_per_s_max']:.0f})", f"{loop[k]['updates_per_s']:.1f}",
                  f"{loop[k]['ms_per_vector_step']:.2f}", f"{loop[k]['cpu_env_steps_per_s']:.0f}"]
                 for k in ("hpcrl", "cleanrl_style")]
                + [["ratio", f"{loop['ratio_wall']:.2f}x", "", "", f"{loop['ratio_cpu']:.2f}x"]])

    # c. data parallel
    t = quiet.start("dp")
    dp = bench_dp(256, *((10, 3, 5) if quick else (25, 5, 9)))
    seconds["dp"] = time.perf_counter() - t
    quiet.end("dp")
    payload["dp"] = dp
    print_table(f"c. data parallel, gloo, per-rank batch {dp['per_rank_batch']}, ms per update "
                f"(median of {dp['repeats']} blocks of {dp['updates_per_block']} updates; slowest rank)",
                ["grad sync", "W=1 ms", "W=2 ms", "DP overhead", "W=1 min", "W=2 min", "overhead (min)",
                 "overhead (cpu time)", "target"],
                [[m, f"{dp['W1'][m]['ms_per_update']:.2f}", f"{dp['W2'][m]['ms_per_update']:.2f}",
                  f"{100 * dp['overhead'][m]:+.1f} %", f"{dp['W1'][m]['ms_min']:.2f}", f"{dp['W2'][m]['ms_min']:.2f}",
                  f"{100 * dp['overhead_min'][m]:+.1f} %", f"{100 * dp['overhead_cpu'][m]:+.1f} %",
                  f"<= {100 * TARGET_DP_OVERHEAD:.0f} %" if m != "cleanrl_style" else "(baseline)"] for m in DP_MODES])
    print(f"view / ddp time at W=2: {dp['view_over_ddp_W2']:.3f} (target <= 1). Bare gloo all-reduces per update "
          f"(critic+alpha {dp['allreduce_us']['critic_alpha']:.0f} us + actor {dp['allreduce_us']['actor']:.0f} us / pf) = "
          f"{dp['allreduce_us']['per_update']:.0f} us = {100 * dp['allreduce_share_of_W1_update']:.1f} % of a W=1 update."
          f"\nNote: {dp['note']}", flush=True)

    # profile when the learner target is missed (or on request)
    missed = [r for r in learner if min(r["ratio_wall"], r["ratio_cpu"]) < TARGET_RATIO]
    if args.profile or any(r["case"] == "pendulum" for r in missed):
        t = time.perf_counter()
        prof = profile_learner("pendulum", 256, 10 if quick else 25)
        seconds["profile"] = time.perf_counter() - t
        payload["profile_pendulum"] = prof
        for key, p in prof.items():
            print_table(f"profile ({key}, pendulum sizes, under torch.profiler): {p['self_cpu_us_per_update']:.0f} us "
                        f"self CPU and {p['ops_per_update']:.0f} aten ops per update, GEMMs (mm/addmm) "
                        f"{100 * p['gemm_share']:.0f} %; top ops by self time",
                        ["op", "calls/update", "us/update", "share"],
                        [[r["op"], f"{r['calls_per_update']:.1f}", f"{r['self_us_per_update']:.0f}",
                          f"{100 * r['share']:.1f} %"] for r in p["top"][:12]])

    # d. learning curve
    if curve:
        t = quiet.start("curve")
        curves = []
        with tempfile.TemporaryDirectory(prefix="sac-curve-") as tmp:
            for nproc in (1, 2):
                curves.append(run_curve(nproc, Path(tmp, f"np{nproc}"), []))
                print(f"curve nproc={nproc}: {curves[-1]['seconds']} s, mean return of the last 2 points "
                      f"{curves[-1]['last2_points_mean_return']}, eval {curves[-1]['eval_return']}", flush=True)
        plot_curves(curves, png_path, "hpcrl FastSAC on Pendulum, python -m hpcrl.sac --preset pendulum\n"
                                      "(8 envs and batch 256 global, 4 updates per env step, 1 thread per rank)")
        seconds["curve"] = time.perf_counter() - t
        quiet.end("curve")
        payload["curve"] = {"png": str(png_path), "runs": curves}
        print_table("d. learning curve (python -m hpcrl.sac --preset pendulum)",
                    ["ranks", "wall s", "env-steps/s (metrics sps)", "return, last 2 points", "eval return"],
                    [[c["nproc"], c["seconds"], c["sps_median"], c["last2_points_mean_return"], c["eval_return"]]
                     for c in curves])
        print(f"curve PNG: {png_path}")

    info["loadavg_end"] = loadavg()
    info["load_per_section"] = quiet.sections
    info["wait_limit"] = args.wait_load
    seconds["total"] = time.perf_counter() - t_start
    seconds["waiting_for_quiet"] = sum(v["waited_s"] for v in quiet.sections.values())
    seconds["total_excluding_waits"] = seconds["total"] - seconds["waiting_for_quiet"]
    payload["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    # Flat numbers (benchmarks/__main__.py turns them into figures; names with "time" = lower is better).
    by_case = {r["case"]: r for r in learner}
    summary: dict[str, Any] = {}
    for case, r in by_case.items():
        summary[f"learner_ratio_{case}"] = round(r["ratio_wall"], 3)
        summary[f"learner_ratio_{case}_cpu"] = round(r["ratio_cpu"], 3)
        summary[f"learner_throughput_hpcrl_{case}"] = round(r["hpcrl"]["updates_per_s"], 2)
        summary[f"learner_throughput_baseline_{case}"] = round(r["cleanrl_style"]["updates_per_s"], 2)
    summary["loop_ratio"] = round(loop["ratio_wall"], 3)
    summary["loop_throughput_hpcrl"] = round(loop["hpcrl"]["env_steps_per_s"], 1)
    summary["loop_throughput_baseline"] = round(loop["cleanrl_style"]["env_steps_per_s"], 1)
    for m in DP_MODES:
        summary[f"dp_overhead_time_{m}"] = round(dp["overhead"][m], 4)
        summary[f"dp_overhead_min_time_{m}"] = round(dp["overhead_min"][m], 4)
    summary["dp_view_over_ddp_time"] = round(dp["view_over_ddp_W2"], 4)
    summary["learner_target_met"] = by_case["pendulum"]["ratio_wall"] >= TARGET_RATIO
    summary["dp_overhead_target_met"] = all(dp["overhead"][m] <= TARGET_DP_OVERHEAD for m in ("flat", "view", "ddp"))
    summary["view_le_ddp"] = dp["view_over_ddp_W2"] <= 1.0
    payload["summary"] = summary
    write_json(json_path, payload)
    print(f"\nload average start {info['loadavg_start']} end {info['loadavg_end']}; per section (1/5/15 min): "
          + "; ".join(f"{k} {v['load_start'][0]}->{v.get('load_end', ['?'])[0]}"
                      + (f", other processes {v['other_processes_cores']} cores" if "other_processes_cores" in v else "")
                      + (f" (waited {v['waited_s']:.0f} s)" if v["waited_s"] else "") for k, v in quiet.sections.items())
          + f"\nsections (s): {payload['seconds']}\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
