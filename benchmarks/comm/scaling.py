"""Scaling sweeps: FastSAC weak / strong scaling over W ranks and detached-PPO topologies.

    python -m benchmarks.comm.scaling [--quick] [--worlds 1,2] [--topologies 1:1,2:1,4:1,4:2] [--launcher local|srun]

Every point is a run of the real CLI, so the numbers are the steady state a user gets: rates are taken from
the cumulative counters of ``metrics.jsonl`` between the first row after warm-up and the last row.
``--launcher local`` starts the ranks on this host (``--nproc`` / the detached launcher's local spawn; gloo
on CPU, NCCL on GPUs). ``--launcher srun`` (inside an allocation: ``slurm/bench.sbatch``) runs every point
as its own ``srun`` step over ceil(W / tasks-per-node) nodes of the allocation, so W spans nodes and the
sweep measures the cluster's interconnect; points that need more tasks than the allocation has are
skipped with a status that says so.

FastSAC (``python -m hpcrl.sac --preset pendulum``; its ``--num-envs`` / ``--batch-size`` are GLOBAL):
  weak   -- per-rank envs E and per-rank batch B fixed (global = W*E, W*B); efficiency = per-rank
            throughput(W) / per-rank throughput(1) = updates/s(W) / updates/s(1) (every rank does the same
            work per update whatever W is).
  strong -- global batch B and global envs E fixed (per rank B/W, E/W); efficiency = speedup / W with
            speedup = updates/s(W) / updates/s(1).
Detached PPO (``python -m hpcrl.ppo --workload cartpole --lag 1``): makers:trainers topologies with
  samples/s, trainer idle fraction and lag mean / max, as logged by the trainer.

Points whose process count per node exceeds the node's CPU count are marked ``oversubscribed`` (on 2 cores
W = 4 or a 4:2 topology measures time-slicing, not scaling). Measured vs modelled: when the run directory
holds collectives.json (the alpha-beta fit of this machine), the weak-scaling update time at W is modelled
as t(1) + ring all-reduce of the pendulum critic + actor/policy_frequency, next to the measured t(W).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.common import schema

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# per-rank / global sizes of the sweep (full, quick)
SAC_SIZES = {False: {"envs": 4, "batch": 128, "vec_steps": 300}, True: {"envs": 2, "batch": 64, "vec_steps": 120}}
PPO_STEPS = {False: 30, True: 10}


# ---------------------------------------------------------------- pure parts (unit-tested)

def parse_topology(s: str) -> tuple[int, int]:
    """'4:2' -> (makers 4, trainers 2)."""
    parts = s.strip().split(":")
    if len(parts) != 2:
        raise ValueError(f"topology {s!r}: expected MAKERS:TRAINERS")
    m, t = (int(p) for p in parts)
    if m < 1 or t < 1:
        raise ValueError(f"topology {s!r}: makers and trainers must be >= 1")
    return m, t


def parse_worlds(s: str) -> list[int]:
    ws = sorted({int(x) for x in s.split(",") if x.strip()})
    if not ws or ws[0] < 1:
        raise ValueError(f"worlds {s!r}: need positive integers")
    return ws


def steady_rate(rows: Sequence[dict[str, Any]], key: str, skip: int = 1) -> float | None:
    """d(key)/d(time) between row ``skip`` and the last row (cumulative counters); None if too few rows."""
    rows = [r for r in rows if isinstance(r.get(key), (int, float)) and isinstance(r.get("time"), (int, float))]
    if len(rows) < skip + 2:
        skip = max(0, len(rows) - 2)
    if len(rows) < 2:
        return None
    a, b = rows[skip], rows[-1]
    dt = b["time"] - a["time"]
    return (b[key] - a[key]) / dt if dt > 0 else None


def ppo_bottleneck(trainer_idle: float | None, maker_idle: float | None, margin: float = 0.1) -> str:
    """Which side of a detached-PPO topology waits for the other, and what to change."""
    if trainer_idle is None or maker_idle is None:
        return "-"
    if maker_idle > trainer_idle + margin:
        return "trainer-bound: makers wait (fewer makers, longer rollouts, or more trainers)"
    if trainer_idle > maker_idle + margin:
        return "maker-bound: trainers wait (more makers)"
    return "balanced"


def weak_efficiency(per_rank: dict[int, float]) -> dict[int, float]:
    """Per-rank throughput at W over per-rank throughput at W=1 (the smallest W present)."""
    base = per_rank[min(per_rank)]
    return {w: v / base for w, v in per_rank.items()}


def strong_efficiency(rates: dict[int, float]) -> dict[int, tuple[float, float]]:
    """W -> (speedup, efficiency = speedup / (W / W0)) against the smallest W0 present."""
    w0 = min(rates)
    return {w: (rates[w] / rates[w0], (rates[w] / rates[w0]) / (w / w0)) for w in rates}


def oversubscribed(processes: int, cpus: int | None = None) -> bool:
    """More processes on a node than it has CPUs (``processes`` per node; this host's CPUs by default)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return processes > cpus


@dataclass(frozen=True)
class Launcher:
    """How the ranks of one sweep point start: ``local`` processes on this host, or an ``srun`` step
    over ceil(W / tasks_per_node) nodes of the current allocation."""

    kind: str = "local"
    nodes: int = 1  # of the allocation (srun)
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 0  # 0: Slurm's default

    @classmethod
    def from_slurm(cls, env: Mapping[str, str] = os.environ) -> "Launcher":
        """The allocation this process runs in (sbatch / salloc variables)."""
        if not env.get("SLURM_JOB_ID"):
            raise ValueError("--launcher srun needs a Slurm allocation (run inside sbatch / salloc: "
                             "slurm/bench.sbatch does); use --launcher local on a workstation")
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        if env.get("SLURM_NTASKS_PER_NODE"):
            tpn = int(env["SLURM_NTASKS_PER_NODE"])
        else:  # e.g. "2(x3),1": the smallest node's count, so that every step fits (bench.sbatch is uniform)
            counts = [int(part.split("(")[0]) for part in env.get("SLURM_TASKS_PER_NODE", "1").split(",")]
            tpn = min(counts)
        gpus = env.get("SLURM_GPUS_PER_NODE", "0").split(":")[-1]  # "4" or "h100:4"
        cpus = env.get("SLURM_CPUS_PER_TASK", "")
        return cls("srun", nodes, tpn, int(gpus) if gpus.isdigit() else 0, int(cpus) if cpus.isdigit() else 0)

    @property
    def capacity(self) -> int:
        return self.nodes * self.tasks_per_node if self.kind == "srun" else 1 << 30

    def per_node(self, ntasks: int) -> int:
        return min(ntasks, self.tasks_per_node) if self.kind == "srun" else ntasks

    def prefix(self, ntasks: int) -> list[str]:
        """Command prefix that starts ``ntasks`` ranks (empty for local: the CLI's own --nproc spawns)."""
        if self.kind == "local":
            return []
        if ntasks > self.capacity:
            raise ValueError(f"needs {ntasks} tasks, the allocation has {self.nodes} node(s) x "
                             f"{self.tasks_per_node} = {self.capacity}")
        per_node = self.per_node(ntasks)
        nodes = -(-ntasks // per_node)
        cmd = ["srun", f"--nodes={nodes}", f"--ntasks={ntasks}", f"--ntasks-per-node={per_node}",
               "--distribution=block", "--kill-on-bad-exit=1"]
        if self.gpus_per_node:
            cmd.append(f"--gpus-per-node={self.gpus_per_node}")  # ranks use cuda:$SLURM_LOCALID
        if self.cpus_per_task:  # srun of Slurm < 23.11 does not inherit the allocation's --cpus-per-task
            cmd.append(f"--cpus-per-task={self.cpus_per_task}")
        return cmd


def sac_args(world: int, mode: str, envs: int, batch: int, vec_steps: int) -> dict[str, int]:
    """Global CLI sizes for one point: weak scales envs/batch with W, strong keeps them global."""
    if mode == "weak":
        g_envs, g_batch = envs * world, batch * world
    elif mode == "strong":
        g_envs, g_batch = envs, batch
        if envs % world or batch % world:
            raise ValueError(f"strong scaling: envs {envs} and batch {batch} must divide by W={world}")
    else:
        raise ValueError(mode)
    return {"num_envs": g_envs, "batch_size": g_batch, "total_env_steps": g_envs * vec_steps}


# ---------------------------------------------------------------- runners

def _rows(run_dir: Path) -> list[dict[str, Any]]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _config(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "config.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[str, float]:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f}s"
    return status, time.perf_counter() - t0


def run_sac_point(world: int, mode: str, sizes: dict[str, int], tmp: Path, logdir: Path,
                  timeout: float, launcher: Launcher = Launcher()) -> dict[str, Any]:
    a = sac_args(world, mode, sizes["envs"], sizes["batch"], sizes["vec_steps"])
    run_dir = tmp / f"sac_{mode}_w{world}"
    ranks = ["--nproc", str(world)] if launcher.kind == "local" else []
    cmd = [*launcher.prefix(world), sys.executable, "-m", "hpcrl.sac", "--preset", "pendulum", *ranks,
           "--num-envs", str(a["num_envs"]), "--batch-size", str(a["batch_size"]),
           "--total-env-steps", str(a["total_env_steps"]), "--run-dir", str(run_dir),
           "--checkpoint-every", "0", "--eval-episodes", "0"]
    status, wall = _run(cmd, logdir / f"scaling_sac_{mode}_w{world}.log", timeout)
    rows = _rows(run_dir)
    ups, sps = steady_rate(rows, "updates"), steady_rate(rows, "env_steps")
    cfg = _config(run_dir)
    if status == "ok" and (ups is None or sps is None):
        status = "failed (no metrics rows)"
    return {"mode": mode, "world": world, "status": status, "wall_s": wall, "rows": len(rows),
            "num_envs": a["num_envs"], "batch_size": a["batch_size"], "total_env_steps": a["total_env_steps"],
            "envs_per_rank": cfg.get("envs_per_rank"), "batch_per_rank": cfg.get("batch_per_rank"),
            "num_updates": cfg.get("num_updates"), "policy_frequency": cfg.get("policy_frequency"),
            "critic_hidden": cfg.get("critic_hidden"), "actor_hidden": cfg.get("actor_hidden"),
            "num_atoms": cfg.get("num_atoms"), "num_q": cfg.get("num_q"),
            "updates_per_s": ups, "env_steps_per_s": sps,
            "env_steps_per_s_per_rank": None if sps is None else sps / world,
            "s_per_update": None if not ups else 1.0 / ups, "launcher": cfg.get("launcher"),
            "nodes": len(set(cfg.get("hosts") or [])) or None,
            "oversubscribed": oversubscribed(launcher.per_node(world)), "command": _shown(cmd)}


def run_ppo_point(makers: int, trainers: int, steps: int, tmp: Path, logdir: Path, timeout: float,
                  launcher: Launcher = Launcher()) -> dict[str, Any]:
    run_dir = tmp / f"ppo_{makers}x{trainers}"
    cmd = [*launcher.prefix(makers + trainers), sys.executable, "-m", "hpcrl.ppo", "--workload", "cartpole", "--makers", str(makers), "--trainers",
           str(trainers), "--lag", "1", "--total-steps", str(steps), "--run-dir", str(run_dir)]
    status, wall = _run(cmd, logdir / f"scaling_ppo_{makers}x{trainers}.log", timeout)
    rows = [r for r in _rows(run_dir) if "samples_per_s" in r]
    steady = rows[1:] if len(rows) > 2 else rows
    mean = lambda k: (sum(r[k] for r in steady) / len(steady)) if steady and all(k in r for r in steady) else None  # noqa: E731
    if status == "ok" and not rows:
        status = "failed (no metrics rows)"
    cfg = _config(run_dir)
    hosts = (cfg.get("hosts") or {}).get("trainers", []) + (cfg.get("hosts") or {}).get("makers", [])
    return {"topology": f"{makers}:{trainers}", "makers": makers, "trainers": trainers, "status": status,
            "wall_s": wall, "steps": steps, "rows": len(rows),
            "samples_per_s": steady_rate(rows, "env_steps"), "samples_per_s_logged_mean": mean("samples_per_s"),
            "trainer_idle_frac": mean("trainer_idle_frac"), "lag_mean": mean("lag_mean"),
            "lag_max": max((r["lag_max"] for r in steady), default=None),
            "dropped_stale": rows[-1].get("dropped_stale") if rows else None,
            "maker_idle_frac": mean("maker_idle_frac"), "launcher": cfg.get("launcher"),
            "nodes": len(set(hosts)) or None,
            "oversubscribed": oversubscribed(launcher.per_node(makers + trainers)), "command": _shown(cmd)}


def _shown(cmd: list[str]) -> str:
    """The command as a user would type it (python for the interpreter's full path)."""
    return " ".join("python" if c == sys.executable else c for c in cmd)


# ---------------------------------------------------------------- analysis, model, plot

def analyse(points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for mode in ("weak", "strong"):
        pts = [p for p in points if p["mode"] == mode and p["updates_per_s"]]
        if not pts:
            out[mode] = []
            continue
        ups = {p["world"]: p["updates_per_s"] for p in pts}
        if mode == "weak":
            eff = weak_efficiency(ups)
            for p in pts:
                p["efficiency"] = eff[p["world"]]
        else:
            se = strong_efficiency(ups)
            for p in pts:
                p["speedup"], p["efficiency"] = se[p["world"]]
        out[mode] = sorted(pts, key=lambda p: p["world"])
    return out


def pendulum_param_bytes(pt: dict[str, Any]) -> tuple[int, int]:
    """fp32 bytes of the pendulum critic (+ log alpha) and actor at this point's sizes."""
    import torch

    from hpcrl.sac.networks import Actor, DistributionalCritic

    actor = Actor(3, 1, int(pt.get("actor_hidden") or 128), torch.tensor([-2.0]), torch.tensor([2.0]))
    critic = DistributionalCritic(3, 1, int(pt.get("critic_hidden") or 128), num_q=int(pt.get("num_q") or 2),
                                  num_atoms=int(pt.get("num_atoms") or 101))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return 4 * (n(critic) + 1), 4 * n(actor)


def model_weak(weak: list[dict[str, Any]], coll_path: Path) -> list[dict[str, Any]] | None:
    """Measured vs modelled per-update time of the weak sweep, from this machine's alpha-beta fit."""
    if not weak or not coll_path.exists():
        return None
    from benchmarks.comm import cost_model as cm

    coll = json.loads(coll_path.read_text())
    rows = [r for r in coll["results"]["rows"] if r["op"] == "all_reduce"]
    if len(rows) < 2:
        return None
    fit = cm.fit_alpha_beta([r["bytes"] for r in rows], [r["time_s"] for r in rows], coll["results"]["world"],
                            "all_reduce", "ring")
    base = weak[0]
    critic_b, actor_b = pendulum_param_bytes(base)
    pf = int(base.get("policy_frequency") or 2)
    out = []
    for p in weak:
        w = p["world"]
        comm = 0.0 if w == 1 else (cm.model_time("all_reduce", "ring", w, critic_b, fit["alpha_s"], fit["beta_s_per_B"])
                                    + cm.model_time("all_reduce", "ring", w, actor_b, fit["alpha_s"],
                                                    fit["beta_s_per_B"]) / pf)
        model = base["s_per_update"] + comm
        out.append({"world": w, "measured_s": p["s_per_update"], "model_s": model, "comm_model_s": comm,
                    "ratio": p["s_per_update"] / model, "oversubscribed": p["oversubscribed"]})
    return out


def plot(ana: dict[str, list], ppo: list[dict[str, Any]], png: Path, where: str = "local ranks, cpu") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, mk in (("weak", "o-"), ("strong", "s-")):
        pts = ana.get(mode) or []
        if pts:
            ws = [p["world"] for p in pts]
            ax[0].plot(ws, [p["updates_per_s"] for p in pts], mk, label=f"{mode}: updates/s")
            ax[1].plot(ws, [p["efficiency"] for p in pts], mk, label=mode)
            for p in pts:
                if p["oversubscribed"]:
                    ax[1].annotate("oversub.", (p["world"], p["efficiency"]), fontsize=8)
    ax[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    ws_all = sorted({p["world"] for pts in ana.values() for p in pts})
    ax[0].set(xscale="log", xlabel="W (ranks)", ylabel="updates / s", title=f"FastSAC pendulum ({where})")
    ax[1].set(xscale="log", xlabel="W (ranks)", ylabel="scaling efficiency", title="weak: per-rank vs W=1; strong: speedup/W")
    for a in ax[:2]:
        a.set_xscale("log", base=2)
        if ws_all:
            a.set_xticks(ws_all, [str(w) for w in ws_all])
        a.legend()
    ok = [p for p in ppo if p["samples_per_s"]]
    if ok:
        xs = range(len(ok))
        ax[2].bar(xs, [p["samples_per_s"] for p in ok],
                  color=["tab:red" if p["oversubscribed"] else "tab:blue" for p in ok])
        ax[2].set_xticks(list(xs), [p["topology"] + ("*" if p["oversubscribed"] else "") for p in ok])
        for x, p in zip(xs, ok):
            ax[2].annotate(f"idle T {_f(p['trainer_idle_frac'], '.2f')} M {_f(p.get('maker_idle_frac'), '.2f')}\n"
                           f"lag {p['lag_mean']:.2f}", (x, p["samples_per_s"]),
                           ha="center", va="bottom", fontsize=8)
        ax[2].set_ylim(0, 1.2 * max(p["samples_per_s"] for p in ok))
    ax[2].set(xlabel="makers:trainers (* oversubscribed)", ylabel="samples / s", title="detached PPO cartpole, lag 1")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def figures(ana: dict[str, list], ppo: list[dict[str, Any]]) -> dict[str, dict]:
    figs: dict[str, dict] = {}
    for mode, pts in ana.items():
        for p in pts:
            w = p["world"]
            figs[f"sac_{mode}_w{w}_updates_per_s"] = schema.figure(p["updates_per_s"], "1/s", True)
            figs[f"sac_{mode}_w{w}_env_steps_per_s"] = schema.figure(p["env_steps_per_s"], "1/s", True)
            figs[f"sac_{mode}_w{w}_efficiency"] = schema.figure(p["efficiency"], "", True)
    for p in ppo:
        if p["samples_per_s"]:
            t = p["topology"].replace(":", "x")
            figs[f"ppo_{t}_samples_per_s"] = schema.figure(p["samples_per_s"], "1/s", True)
            for side in ("trainer", "maker"):
                if p.get(f"{side}_idle_frac") is not None:
                    figs[f"ppo_{t}_{side}_idle"] = schema.figure(p[f"{side}_idle_frac"], "", False)
    return figs


def run(quick: bool, worlds: list[int], topologies: list[str], outdir: Path, device: str = "cpu",
        timeout: float = 600.0, progress: Any = print, launcher: Launcher = Launcher()) -> dict[str, Any]:
    sizes = SAC_SIZES[quick]
    # srun points may run on other nodes: their run directories must be on the (shared) output directory
    tmp = (Path(tempfile.mkdtemp(prefix="hpcrl_scaling_")) if launcher.kind == "local"
           else Path(tempfile.mkdtemp(prefix="scaling_runs_", dir=outdir)))
    points: list[dict[str, Any]] = []
    ppo: list[dict[str, Any]] = []
    try:
        for mode in ("weak", "strong"):
            for w in worlds:
                try:
                    pt = run_sac_point(w, mode, sizes, tmp, outdir, timeout, launcher)
                except ValueError as e:
                    pt = {"mode": mode, "world": w, "status": f"skipped: {e}", "updates_per_s": None,
                          "oversubscribed": oversubscribed(launcher.per_node(w))}
                points.append(pt)
                progress(f"  sac {mode} W={w}: {pt['status']}, updates/s {pt.get('updates_per_s')}")
        for topo in topologies:
            m, t = parse_topology(topo)
            try:
                pt = run_ppo_point(m, t, PPO_STEPS[quick], tmp, outdir, timeout, launcher)
            except ValueError as e:
                pt = {"topology": f"{m}:{t}", "makers": m, "trainers": t, "status": f"skipped: {e}",
                      "samples_per_s": None, "trainer_idle_frac": None, "maker_idle_frac": None, "lag_mean": None,
                      "lag_max": None, "dropped_stale": None, "oversubscribed": oversubscribed(launcher.per_node(m + t))}
            ppo.append(pt)
            progress(f"  ppo {topo}: {pt['status']}, samples/s {pt['samples_per_s']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ana = analyse(points)
    model = None
    try:
        model = model_weak(ana.get("weak", []), outdir / "collectives.json")
    except Exception as e:  # noqa: BLE001 - the model is a bonus, the measurement is the point
        progress(f"  measured-vs-modelled skipped: {type(e).__name__}: {e}")
    png = outdir / "scaling.png"
    where = ("local ranks" if launcher.kind == "local"
             else f"srun steps, up to {launcher.nodes} node(s) x {launcher.tasks_per_node}")
    plot(ana, ppo, png, f"{where}, {device}")
    failed = [p for p in points + ppo if not str(p["status"]).startswith(("ok", "skipped"))]
    results = {"sac": points, "sac_weak": ana.get("weak", []), "sac_strong": ana.get("strong", []), "ppo": ppo,
               "model_weak": model, "sizes": sizes, "cpu_count": os.cpu_count(), "png": png.name,
               "launcher": dataclasses.asdict(launcher),
               "status": "ok" if not failed else f"{len(failed)} point(s) failed"}
    hdr = schema.header(device, max(worlds), {"quick": quick, "worlds": worlds, "topologies": topologies,
                                              "launcher": launcher.kind, **sizes})
    return schema.make("scaling", hdr, figures(ana, ppo), results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worlds", default="1,2", help="comma-separated W (4 oversubscribes a 2-core machine)")
    ap.add_argument("--topologies", default="1:1,2:1,4:1,4:2")
    ap.add_argument("--out", default=".", help="directory for scaling.json, scaling.png and logs")
    ap.add_argument("--timeout", type=float, default=600.0, help="per point")
    ap.add_argument("--launcher", default="local", choices=["local", "srun"],
                    help="srun: each point is an srun step across the allocation's nodes (inside sbatch/salloc)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = Launcher.from_slurm() if args.launcher == "srun" else Launcher()
    doc = run(args.quick, parse_worlds(args.worlds), [t for t in args.topologies.split(",") if t], out,
              timeout=args.timeout, launcher=launcher)
    from benchmarks.common.timing import write_json

    write_json(out / "scaling.json", doc)
    print("\n".join(report_lines(doc)))
    return 0 if doc["results"]["status"] == "ok" else 1


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def report_lines(doc: dict[str, Any]) -> list[str]:
    r = doc["results"]
    la = r.get("launcher") or {"kind": "local"}
    where = ("local ranks on one host" if la["kind"] == "local" else
             f"one srun step per point over up to {la['nodes']} node(s) x {la['tasks_per_node']} task(s)")
    out = [f"## Scaling sweeps ({r['cpu_count']} CPUs; * = more processes per node than CPUs, time-sliced)", "",
           f"{where.capitalize()}. FastSAC pendulum. Weak: {r['sizes']['envs']} envs and batch {r['sizes']['batch']} "
           f"per rank; strong: {r['sizes']['envs']} envs and batch {r['sizes']['batch']} in total. Steady-state rates "
           "from metrics.jsonl counters.", "",
           "| mode | W | nodes | global envs / batch | updates/s | env-steps/s | env-steps/s per rank | speedup | "
           "efficiency | status |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["sac"]:
        star = "*" if p.get("oversubscribed") else ""
        out.append(f"| {p['mode']} | {p['world']}{star} | {_f(p.get('nodes'), 'd')} | "
                   f"{p.get('num_envs', '-')} / {p.get('batch_size', '-')} | "
                   f"{_f(p.get('updates_per_s'), '.1f')} | {_f(p.get('env_steps_per_s'), '.1f')} | "
                   f"{_f(p.get('env_steps_per_s_per_rank'), '.1f')} | {_f(p.get('speedup'), '.2f')} | "
                   f"{_f(p.get('efficiency'), '.2f')} | {p['status']} |")
    if r.get("model_weak"):
        out += ["", "Weak scaling, measured vs modelled per-update time (t(1) + alpha-beta ring all-reduce of the "
                    "pendulum critic + actor / policy_frequency, fit from collectives.json):", "",
                "| W | measured | modelled | modelled comm | measured / modelled |", "|---:|---:|---:|---:|---:|"]
        for m in r["model_weak"]:
            out.append(f"| {m['world']}{'*' if m['oversubscribed'] else ''} | {m['measured_s'] * 1e3:.2f} ms | "
                       f"{m['model_s'] * 1e3:.2f} ms | {m['comm_model_s'] * 1e3:.3f} ms | {m['ratio']:.2f} |")
    out += ["", "Detached PPO, cartpole, lag 1 (from the trainers' metrics rows; maker idle = share of the makers' "
                "time behind each step's batches not spent collecting):", "",
            "| makers:trainers | nodes | samples/s | trainer idle | maker idle | lag mean | lag max | dropped stale | "
            "reading | status |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for p in r["ppo"]:
        out.append(f"| {p['topology']}{'*' if p['oversubscribed'] else ''} | {_f(p.get('nodes'), 'd')} | "
                   f"{_f(p['samples_per_s'], '.0f')} | {_f(p['trainer_idle_frac'], '.2f')} | "
                   f"{_f(p.get('maker_idle_frac'), '.2f')} | {_f(p['lag_mean'], '.2f')} | {_f(p['lag_max'], '.0f')} | "
                   f"{_f(p['dropped_stale'], '.0f')} | {ppo_bottleneck(p['trainer_idle_frac'], p.get('maker_idle_frac'))} | "
                   f"{p['status']} |")
    if r.get("png"):
        out += ["", f"![scaling]({r['png']})"]
    return out + [""]

if __name__ == "__main__":
    sys.exit(main())
