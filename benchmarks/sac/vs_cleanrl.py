#!/usr/bin/env python
"""hpcrl's FastSAC against the real CleanRL SAC, one (task, seed, system) per invocation, then merged.

    python benchmarks/sac/vs_cleanrl.py --task halfcheetah|hopper --seed K --system cleanrl|hpcrl
                                    [--env-steps 50000] [--eval-every 5000] [--eval-episodes 5]
                                    [--threads 1] [--hpcrl-preset P] [--hpcrl-flags "..."]
                                    [--cleanrl-flags "..."] [--out DIR]
    python benchmarks/sac/vs_cleanrl.py --merge [--out DIR]
    python benchmarks/sac/vs_cleanrl.py --quick --system cleanrl|hpcrl --seed K --out DIR   (Pendulum-v1, tiny)

A part writes ``DIR/vs_cleanrl/<task>-<system>-seed<K>.json`` (common schema, benchmarks/common/schema.py): its
curve of deterministic eval returns against env steps and training wall seconds. ``--merge`` reads every
part there and writes ``DIR/vs_cleanrl.json`` (mean and std over seeds of each system at each eval point,
against env steps and against wall time; the issue's targets) and ``DIR/vs_cleanrl.png``.

- cleanrl: CleanRL's ``sac_continuous_action.py`` (got at run time from a pinned upstream commit, each file
  checked against its recorded sha-256 before it runs: benchmarks/peers/cleanrl_source.py; ``--cleanrl-src DIR``
  for a checkout at hand; missing and not fetchable: one line saying how to get it, exit 2) with its own defaults and CLI (``--env-id ENV-v4
  --total-timesteps N --no-cuda --seed K``, plus ``--cleanrl-flags``: e.g. its warm-up cut with
  ``--learning-starts 512``), a process of the peer venv (tools/peer_venv.sh: gymnasium
  0.29.1, which has the v4 MuJoCo tasks and the vector API the script needs), through
  benchmarks/peers/run_cleanrl.py, which evaluates it on the way.
- hpcrl: ``python -m hpcrl.sac --preset P --env gym:ENV-v5 [--hpcrl-flags] ...`` (main venv,
  gymnasium 1.x: v5), its own eval rows (hpcrl.sac.evaluate).

One protocol for both: every ``--eval-every`` env steps and at the end, the deterministic policy
(tanh(mean) scaled to the action box) on ``--eval-episodes`` fresh envs, one episode each; the eval's
time is taken out of the wall clock, which starts after each system's build (CleanRL: its env reset
before its loop; hpcrl: its metrics logger's start). An eval is filed under the nearest multiple of ``--eval-every``:
CleanRL's hook fires at the script's first log past the point (at most 100 env steps late), hpcrl
evaluates every round(eval_every / num_envs) vector steps (at most num_envs / 2 per point early or late).
Both run 1 torch thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, write_json  # noqa: E402
from benchmarks.peers import cleanrl_source  # noqa: E402

RUNNER = REPO / "benchmarks" / "peers" / "run_cleanrl.py"
PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
TASKS = {  # task -> (CleanRL's env id, hpcrl's env, hpcrl's default preset)
    "halfcheetah": ("HalfCheetah-v4", "gym:HalfCheetah-v5", "halfcheetah"),
    "hopper": ("Hopper-v4", "gym:Hopper-v5", "halfcheetah"),
    "pendulum": ("Pendulum-v1", "gym:Pendulum-v1", "pendulum"),
}
ENV_NOTE = ("CleanRL runs the v4 tasks of gymnasium 0.29.1 (mujoco<3.2, what its script supports), hpcrl the v5 "
            "tasks of the main venv's gymnasium 1.x (mujoco 3.2+): the same model files and rewards, except "
            "that Hopper-v5 pays the healthy reward only while healthy (v4 also on the terminating step, so "
            "at most +1 per episode for v4); v5 otherwise adds options and reset infos only "
            "(gymnasium's v5 version history). The MuJoCo versions differ, so trajectories differ numerically.")
SOLVED = {"pendulum": -250.0}  # task -> the mean eval return that counts as solved (time to solve)
QUICK = {"env_steps": 400, "eval_every": 200, "eval_episodes": 2}
QUICK_CLEANRL = ["--learning-starts", "100", "--batch-size", "32"]
QUICK_HPCRL = ("--num-envs 2 --batch-size 32 --buffer-size 256 --actor-hidden 16 --critic-hidden 16 "
               "--num-atoms 11 --learning-starts 8 --random-steps 8")


# -- one part --------------------------------------------------------------------------------------------

def snap(points: list[dict], every: int) -> list[dict]:
    """File each eval under the nearest multiple of ``every`` (> 0); of two at one point keep the nearer."""
    best: dict[int, dict] = {}
    for p in points:
        k = round(p["env_steps_actual"] / every) * every
        if k <= 0:
            continue
        if k not in best or abs(p["env_steps_actual"] - k) <= abs(best[k]["env_steps_actual"] - k):
            best[k] = {**p, "env_steps": k}
    return [best[k] for k in sorted(best)]


def run_logged(cmd: list[str], log: Path, cwd: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")


def run_cleanrl(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    src = cleanrl_source.locate(a.cleanrl_src)  # PeerSourceError: main's one line, exit 2
    if not Path(a.peer_python).exists():
        raise SystemExit(f"vs_cleanrl: {a.peer_python} missing: run `bash tools/peer_venv.sh` first")
    env_id = TASKS[a.task][0]
    script = ["--env-id", env_id, "--total-timesteps", str(a.env_steps), "--no-cuda", "--seed", str(a.seed),
              *(QUICK_CLEANRL if a.quick else []), *shlex.split(a.cleanrl_flags)]
    cmd = [str(a.peer_python), str(RUNNER), "--cleanrl-src", str(src), "--out", str(work / "curve.json"),
           "--eval-every", str(a.eval_every), "--eval-episodes", str(a.eval_episodes), "--threads", str(a.threads),
           "--workdir", str(work), "--", *script]
    run_logged(cmd, work / "run.log", REPO)
    doc = json.loads((work / "curve.json").read_text())
    return {"env_id": env_id, "points": doc["points"], "versions": doc.get("versions", {}),
            "command": shlex.join(["python", "cleanrl/sac_continuous_action.py", *script]),
            "runner": shlex.join(cmd), "hyper_parameters": "CleanRL's defaults" + (" + quick sizes" if a.quick else "")
            + (f" + {a.cleanrl_flags}" if a.cleanrl_flags else "")}


def hpcrl_argv(a: argparse.Namespace) -> tuple[list[str], Any]:
    """hpcrl.sac's flags: preset < task env < --hpcrl-flags < the protocol's (eval grid, budget, seed)."""
    from hpcrl.sac.__main__ import parse

    preset = a.hpcrl_preset or TASKS[a.task][2]
    user = ["--preset", preset, "--env", TASKS[a.task][1], *shlex.split(QUICK_HPCRL if a.quick else ""),
            *shlex.split(a.hpcrl_flags)]
    cfg = parse(user)
    every = max(1, round(a.eval_every / cfg.num_envs))  # vector steps between evals
    log_every = max(d for d in range(1, min(every, cfg.log_every) + 1) if every % d == 0)
    per_rank = -(-a.eval_episodes // cfg.nproc)  # hpcrl evaluates that many per rank: at least E in all
    protocol = ["--total-env-steps", str(a.env_steps), "--seed", str(a.seed), "--threads", str(a.threads),
                "--device", "cpu", "--eval-every", str(every), "--eval-episodes", str(per_rank),
                "--log-every", str(log_every), "--checkpoint-every", "0"]
    return user + protocol, parse(user + protocol)


def hpcrl_points(rows: list[dict]) -> list[dict]:
    """Eval rows -> points. An eval row follows the training row of its env step, so its time minus that
    row's is the eval's duration, taken out of the wall clock from then on."""
    train_time = {r["env_steps"]: r["time"] for r in rows if "eval_return" not in r}
    points, evals_s = [], 0.0
    for r in rows:
        if r.get("eval_return") is None:
            continue
        start = train_time.get(r["env_steps"], r["time"])
        points.append({"env_steps_actual": r["env_steps"], "wall_s": round(start - evals_s, 3),
                       "eval_return": r["eval_return"], "eval_s": round(r["time"] - start, 3)})
        evals_s += r["time"] - start
    return points


def run_hpcrl(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    argv, cfg = hpcrl_argv(a)
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "hpcrl.sac", *argv, "--run-dir", str(run_dir), "--overwrite"]
    run_logged(cmd, work / "run.log", REPO)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    import gymnasium
    import torch

    return {"env_id": cfg.env.removeprefix("gym:"), "points": hpcrl_points(rows),
            "command": shlex.join(["python", "-m", "hpcrl.sac", *argv]), "hyper_parameters": f"--preset {cfg.preset}",
            "eval_episodes_per_rank": cfg.eval_episodes, "num_envs": cfg.num_envs, "nproc": cfg.nproc,
            "versions": {"torch": torch.__version__, "gymnasium": gymnasium.__version__,
                         "mujoco": _version("mujoco"), "numpy": _version("numpy")}}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def part_name(task: str, system: str, seed: int) -> str:
    return f"{task}-{system}-seed{seed}"


def run_part(a: argparse.Namespace) -> Path:
    name = part_name(a.task, a.system, a.seed)
    work = Path(a.work) / name
    load_before, t0 = loadavg(), time.perf_counter()
    got = (run_cleanrl if a.system == "cleanrl" else run_hpcrl)(a, work)
    points = snap(got.pop("points"), a.eval_every)
    setup = {"task": a.task, "system": a.system, "env_steps": a.env_steps, "eval_every": a.eval_every,
             "eval_episodes": a.eval_episodes, "threads": a.threads, "quick": a.quick,
             "hpcrl_preset": a.hpcrl_preset, "hpcrl_flags": a.hpcrl_flags, "cleanrl_flags": a.cleanrl_flags}
    results = {**setup, "seed": a.seed, **got, "process_wall_s": round(time.perf_counter() - t0, 1),
               "load_before": load_before, "load_after": loadavg(), "env_note": ENV_NOTE,
               "curve": {k: [p.get(k) for p in points] for k in ("env_steps", "env_steps_actual", "wall_s",
                                                                  "eval_return", "eval_s")}}
    last = points[-1] if points else {}
    figs = {k: schema.figure(v, u, h) for k, v, u, h in
            (("final_eval_return", last.get("eval_return"), "return", True), ("wall_s", last.get("wall_s"), "s", False))
            if isinstance(v, (int, float)) and math.isfinite(v)}
    doc = schema.make("vs_cleanrl_part", schema.header("cpu", 1, setup), figs, results)
    path = write_json(Path(a.out) / "vs_cleanrl" / f"{name}.json", doc)
    print(f"vs_cleanrl: {name}: {len(points)} eval points, last {last.get('eval_return')} at "
          f"{last.get('env_steps')} env steps, {last.get('wall_s')} s -> {path}")
    return path


# -- merge -----------------------------------------------------------------------------------------------

def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def aggregate(parts: list[dict]) -> dict[str, Any]:
    """One (task, system)'s seeds -> mean and std (over seeds, ddof 0) at the eval points all seeds have."""
    # parts written before --cleanrl-flags existed ran without any
    setups = {json.dumps({"cleanrl_flags": "", **p["header"]["config"]}, sort_keys=True) for p in parts}
    if len(setups) > 1:
        raise ValueError(f"parts of one task and system ran with different setups: {sorted(setups)}")
    curves = [p["results"]["curve"] for p in parts]
    steps = sorted(set.intersection(*(set(c["env_steps"]) for c in curves)))
    out: dict[str, Any] = {"seeds": sorted(p["results"]["seed"] for p in parts), "env_steps": steps,
                           "return_mean": [], "return_std": [], "wall_s_mean": [], "wall_s_std": []}
    for s in steps:
        at = [c["env_steps"].index(s) for c in curves]
        for key, col in (("return", "eval_return"), ("wall_s", "wall_s")):
            m, sd = mean_std([c[col][i] for c, i in zip(curves, at)])
            out[f"{key}_mean"].append(round(m, 3))
            out[f"{key}_std"].append(round(sd, 3))
    first = parts[0]["results"]
    out.update(env_id=first["env_id"], command=first["command"], versions=first.get("versions", {}),
               loads=[[p["results"]["load_before"], p["results"]["load_after"]] for p in parts])
    return out


def at_step(agg: dict[str, Any], step: int) -> float | None:
    return agg["return_mean"][agg["env_steps"].index(step)] if step in agg["env_steps"] else None


def solved_at(agg: dict[str, Any], goal: float) -> tuple[int | None, float | None]:
    """(env steps, wall s) of the first eval point whose mean return reaches ``goal``."""
    return next(((s, w) for s, r, w in zip(agg["env_steps"], agg["return_mean"], agg["wall_s_mean"]) if r >= goal),
                (None, None))


def targets(peer: dict[str, Any], ours: dict[str, Any], env_steps: int, task: str = "") -> dict[str, Any]:
    """The targets: returns at half and all of the budget; hpcrl's wall time to CleanRL's final mean
    return over CleanRL's wall time for the budget (when CleanRL's final is above its first eval); for a
    task with a :data:`SOLVED` return, each system's time to reach it and CleanRL's over hpcrl's."""
    out: dict[str, Any] = {}
    if task in SOLVED:
        (c_steps, c_wall), (h_steps, h_wall) = solved_at(peer, SOLVED[task]), solved_at(ours, SOLVED[task])
        out["time_to_solve"] = {"solved_return": SOLVED[task], "cleanrl_env_steps": c_steps, "cleanrl_wall_s": c_wall,
                                "hpcrl_env_steps": h_steps, "hpcrl_wall_s": h_wall,
                                "speedup": None if c_wall is None or h_wall is None else round(c_wall / h_wall, 3)}
    for step in (env_steps // 2, env_steps):
        c, h = at_step(peer, step), at_step(ours, step)
        out[f"at_{step}"] = {"cleanrl": c, "hpcrl": h, "hpcrl_minus_cleanrl": None if c is None or h is None
                             else round(h - c, 3)}
    # a goal CleanRL's own first eval meets already (a short run) would time hpcrl's untrained policy
    if len(peer["env_steps"]) > 1 and ours["env_steps"] and peer["return_mean"][-1] > peer["return_mean"][0]:
        goal, peer_wall = peer["return_mean"][-1], peer["wall_s_mean"][-1]
        reach = next((w for r, w in zip(ours["return_mean"], ours["wall_s_mean"]) if r >= goal), None)
        out["time_to_cleanrl_final"] = {"cleanrl_final_return": goal, "cleanrl_wall_s": peer_wall,
                                        "hpcrl_wall_s": reach,
                                        "ratio": None if reach is None else round(reach / peer_wall, 3)}
    return out


def merge_figures(tasks: dict[str, dict]) -> dict[str, dict]:
    figs = {}
    for task, t in tasks.items():
        for key, tgt in t.get("targets", {}).items():
            for name, v in tgt.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    better = not name.endswith(("wall_s", "env_steps")) and name != "ratio"
                    unit = ("s" if name.endswith("wall_s") else "env steps" if name.endswith("env_steps")
                            else "x" if name in ("ratio", "speedup") else "return")
                    figs[f"{task}_{key}_{name}"] = schema.figure(v, unit, better)
    return figs


def merge(out: Path) -> Path:
    paths = sorted((out / "vs_cleanrl").glob("*.json"))
    if not paths:
        raise SystemExit(f"vs_cleanrl --merge: no parts in {out / 'vs_cleanrl'}")
    groups: dict[str, dict[str, list]] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        errs = schema.validate(doc)
        if errs:
            raise SystemExit(f"vs_cleanrl --merge: {path}: {errs}")
        r = doc["results"]
        groups.setdefault(r["task"], {}).setdefault(r["system"], []).append(doc)
    tasks: dict[str, dict] = {}
    for task, systems in sorted(groups.items()):
        tasks[task] = {system: aggregate(parts) for system, parts in sorted(systems.items())}
        if {"cleanrl", "hpcrl"} <= systems.keys():
            tasks[task]["targets"] = targets(tasks[task]["cleanrl"], tasks[task]["hpcrl"],
                                             systems["cleanrl"][0]["results"]["env_steps"], task)
    results = {"tasks": tasks, "parts": [p.name for p in paths], "env_note": ENV_NOTE, "png": "vs_cleanrl.png",
               "peer": {"repo": "vwxyzjn/cleanrl", "commit": cleanrl_source.COMMIT, "files": cleanrl_source.FILES}}
    doc = schema.make("vs_cleanrl", schema.header("cpu", 1, {"parts": len(paths)}), merge_figures(tasks), results)
    errs = schema.validate(doc)
    if errs:
        raise ValueError(f"vs_cleanrl: {errs}")
    path = write_json(out / "vs_cleanrl.json", doc)
    plot(tasks, out / "vs_cleanrl.png", doc["header"])
    print(f"vs_cleanrl: merged {len(paths)} parts -> {path}, {out / 'vs_cleanrl.png'}")
    return path


def plot(tasks: dict[str, dict], png: Path, header: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
    for row, (task, systems) in zip(axes, tasks.items()):
        for system in ("cleanrl", "hpcrl"):
            agg = systems.get(system)
            if not agg or not agg["env_steps"]:
                continue
            name = "CleanRL SAC" if system == "cleanrl" else "hpcrl FastSAC"
            label = f"{name} ({agg['env_id']}, seeds {agg['seeds']})"
            m, sd = agg["return_mean"], agg["return_std"]
            line, = row[0].plot(agg["env_steps"], m, marker="o", label=label)
            row[0].fill_between(agg["env_steps"], [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                                color=line.get_color(), alpha=0.2)
            row[1].errorbar(agg["wall_s_mean"], m, xerr=agg["wall_s_std"], yerr=sd, marker="o", capsize=3,
                            color=line.get_color(), label=label)
        row[0].set_xlabel("env steps")
        row[1].set_xlabel("training wall seconds (evals excluded)")
        for ax in row:
            ax.set_ylabel(f"{task}: deterministic eval return")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    loads = [x[0] for t in tasks.values() for agg in t.values() for pair in agg.get("loads", []) for x in pair
             if x]  # 1-minute load averages before and after each part
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    fig.suptitle(f"hpcrl vs CleanRL SAC, mean ± std over seeds; {header['cpu_model']} ({header['cpu_count']} "
                 f"cores, shared{load}), {header['date'][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- command line ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="halfcheetah")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", choices=("cleanrl", "hpcrl"))
    p.add_argument("--env-steps", type=int, default=50_000)
    p.add_argument("--eval-every", type=int, default=5_000, help="env steps between evals")
    p.add_argument("--eval-episodes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads of either system")
    p.add_argument("--hpcrl-preset", default="", help="default: halfcheetah (pendulum for --quick)")
    p.add_argument("--hpcrl-flags", default="", help="more `python -m hpcrl.sac` flags (before the protocol's)")
    p.add_argument("--cleanrl-flags", default="", help="more CleanRL script flags (after its defaults' CLI)")
    p.add_argument("--cleanrl-src", default=None, help="a checkout of vwxyzjn/cleanrl at the pinned commit "
                   f"(default: ${cleanrl_source.ENV_VAR}, else the cache, fetched into when empty)")
    p.add_argument("--peer-python", default=str(PEER_PYTHON), help="the peer venv's python (tools/peer_venv.sh)")
    p.add_argument("--out", default="", help="default benchmarks/results (a temp dir with --quick)")
    p.add_argument("--work", default="", help="run dirs and logs; default runs/vs_cleanrl (under --out with --quick)")
    p.add_argument("--quick", action="store_true", help="Pendulum-v1, 400 env steps, tiny sizes (a test)")
    p.add_argument("--merge", action="store_true", help="merge the parts in OUT/vs_cleanrl")
    a = p.parse_args(argv)
    if a.quick:
        a.task = "pendulum"
        vars(a).update(QUICK)
        a.out = a.out or tempfile.mkdtemp(prefix="vs_cleanrl_")
    a.out = a.out or str(RESULTS)
    a.work = a.work or str(Path(a.out) / "vs_cleanrl_work" if a.quick else REPO / "runs" / "vs_cleanrl")
    if not a.merge and not a.system:
        p.error("--system cleanrl|hpcrl is required (or --merge)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        merge(Path(a.out))
        return 0
    try:
        run_part(a)
    except cleanrl_source.PeerSourceError as e:
        print(f"vs_cleanrl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
