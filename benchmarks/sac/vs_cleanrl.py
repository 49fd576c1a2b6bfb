#!/usr/bin/env python
"""hpcrl's FastSAC against the real CleanRL SAC (and LeanRL's compiled fork of it), one (task, seed, system)
per invocation, then merged.

    python benchmarks/sac/vs_cleanrl.py --task halfcheetah|hopper|pendulum --seed K --system cleanrl|leanrl|hpcrl
                                    [--label NAME] [--env-steps 50000] [--eval-every 5000] [--eval-episodes 5]
                                    [--threads 1] [--hpcrl-preset P] [--hpcrl-flags "..."]
                                    [--cleanrl-flags "..."] [--leanrl-flags "..."] [--out DIR]
    python benchmarks/sac/vs_cleanrl.py --merge [--out DIR]
    python benchmarks/sac/vs_cleanrl.py --quick --system cleanrl|leanrl|hpcrl --seed K --out DIR   (Pendulum-v1, tiny)

A part writes ``DIR/vs_cleanrl/<task>-<label>-seed<K>.json`` (common schema, benchmarks/common/schema.py): its
curve of deterministic eval returns against env steps and the two clocks below. ``--label`` (default: the
system) tells configurations of one system apart (e.g. ``hpcrl-compile``). ``--merge`` reads every part there
and writes ``DIR/vs_cleanrl.json`` (mean and std over seeds of each label at each eval point, against env steps
and against wall time; each label's targets against the ``cleanrl`` label) and ``DIR/vs_cleanrl.png``.

- cleanrl: CleanRL's ``sac_continuous_action.py`` with its own defaults and CLI (``--env-id ENV-v4
  --total-timesteps N --no-cuda --seed K``, plus ``--cleanrl-flags``: e.g. its warm-up cut with
  ``--learning-starts 512``).
- leanrl: LeanRL's ``sac_continuous_action_torchcompile.py`` (CleanRL's SAC on tensordict / torchrl with
  ``torch.compile``), the same CLI plus ``--compile``, and ``--leanrl-flags``; W&B disabled.
- Both peers' sources are got at run time from pinned upstream commits, each file checked against its recorded
  sha-256 before it runs (benchmarks/peers/sources.py; ``--cleanrl-src DIR`` / ``--leanrl-src DIR`` for a
  checkout at hand; missing and not fetchable: one line saying how to get it, exit 2). They run in the peer
  venv (tools/peer_venv.sh: gymnasium 0.29.1, which has the v4 MuJoCo tasks and the vector API the scripts
  need) through benchmarks/peers/run_cleanrl.py, which evaluates them on the way.
- hpcrl: ``python -m hpcrl.sac --preset P --env gym:ENV-v5 [--hpcrl-flags] ...`` (main venv,
  gymnasium 1.x: v5), its own eval rows (hpcrl.sac.evaluate).

One protocol for every system: every ``--eval-every`` env steps and at the end, the deterministic policy
(tanh(mean) scaled to the action box) on ``--eval-episodes`` fresh envs, one episode each. Two clocks, the
evals' time taken out of both: *training* starts after each system's build (the peers: their env reset
before the loop; hpcrl: its metrics logger's start); *from launch* starts when this script starts the
system's process (interpreter start, imports, env and network build, compile included). An eval is filed under
the nearest multiple of ``--eval-every``: the peers' hook fires at the script's first log past the point
(at most 100 env steps late), hpcrl evaluates every round(eval_every / num_envs) vector steps (at most
num_envs / 2 per point early or late). Solved (tasks in :data:`SOLVED`): a seed's first eval point whose mean
return reaches the task's solved return; a label's time to solve is the mean over its seeds, on each clock,
given only when every seed solved. All systems run 1 torch thread by default (``--threads``).
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
from benchmarks.peers.sources import CLEANRL, LEANRL, PEERS, PeerSourceError  # noqa: E402

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


def run_logged(cmd: list[str], log: Path, cwd: Path, watch: Path | None = None) -> float | None:
    """Run ``cmd`` to its end, output to ``log``. With ``watch``: the epoch time its first line appeared (polled
    every 10 ms; the file is removed first)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if watch is not None and watch.exists():
        watch.unlink()
    seen = None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        while proc.poll() is None:
            if seen is None and watch is not None and watch.exists() and b"\n" in watch.read_bytes()[:65536]:
                seen = time.time()
            time.sleep(0.01 if seen is None and watch is not None else 0.2)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
    return seen


def run_peer(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """CleanRL's or LeanRL's script in the peer venv; its curve, and its clock start as epoch seconds."""
    peer = PEERS[a.system]
    src = peer.locate(getattr(a, f"{a.system}_src"))  # PeerSourceError: main's one line, exit 2
    if not Path(a.peer_python).exists():
        raise SystemExit(f"vs_cleanrl: {a.peer_python} missing: run `bash tools/peer_venv.sh` first")
    env_id, flags = TASKS[a.task][0], getattr(a, f"{a.system}_flags")
    script = ["--env-id", env_id, "--total-timesteps", str(a.env_steps), "--no-cuda", "--seed", str(a.seed),
              *(["--compile"] if a.system == "leanrl" else []), *(QUICK_CLEANRL if a.quick else []),  # one CLI
              *shlex.split(flags)]
    cmd = [str(a.peer_python), str(RUNNER), "--peer", a.system, "--src", str(src), "--out", str(work / "curve.json"),
           "--eval-every", str(a.eval_every), "--eval-episodes", str(a.eval_episodes), "--threads", str(a.threads),
           "--workdir", str(work), "--", *script]
    run_logged(cmd, work / "run.log", REPO)
    doc = json.loads((work / "curve.json").read_text())
    return {"env_id": env_id, "points": doc["points"], "versions": doc.get("versions", {}),
            "clock_start_unix": doc["clock_start_unix"], "peer": {"repo": peer.repo, "commit": peer.commit},
            "command": shlex.join(["python", peer.script, *script]), "runner": shlex.join(cmd),
            "hyper_parameters": f"{peer.name}'s defaults" + (" + quick sizes" if a.quick else "")
            + (f" + {flags}" if flags else "")}


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
    seen = run_logged(cmd, work / "run.log", REPO, watch=run_dir / "metrics.jsonl")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    import gymnasium
    import torch

    # a row's "time" counts from the logger's start: the first row seen at `seen` dates that start
    return {"env_id": cfg.env.removeprefix("gym:"), "points": hpcrl_points(rows),
            "clock_start_unix": None if seen is None else seen - rows[0]["time"],
            "command": shlex.join(["python", "-m", "hpcrl.sac", *argv]), "hyper_parameters": f"--preset {cfg.preset}",
            "eval_episodes_per_rank": cfg.eval_episodes, "num_envs": cfg.num_envs, "nproc": cfg.nproc,
            "versions": {"torch": torch.__version__, "gymnasium": gymnasium.__version__,
                         "mujoco": _version("mujoco"), "numpy": _version("numpy")}}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def part_name(task: str, label: str, seed: int) -> str:
    return f"{task}-{label}-seed{seed}"


def run_part(a: argparse.Namespace) -> Path:
    label = a.label or a.system
    name = part_name(a.task, label, a.seed)
    work = Path(a.work) / name
    load_before, t0 = loadavg(), time.perf_counter()
    launch_unix = time.time()
    got = (run_hpcrl if a.system == "hpcrl" else run_peer)(a, work)
    start = got.pop("clock_start_unix")
    startup_s = None if start is None else round(start - launch_unix, 3)  # launch -> the training clock's start
    points = snap(got.pop("points"), a.eval_every)
    for pt in points:
        pt["launch_s"] = None if startup_s is None else round(startup_s + pt["wall_s"], 3)
    setup = {"task": a.task, "system": a.system, "label": label, "env_steps": a.env_steps, "eval_every": a.eval_every,
             "eval_episodes": a.eval_episodes, "threads": a.threads, "quick": a.quick,
             "hpcrl_preset": a.hpcrl_preset, "hpcrl_flags": a.hpcrl_flags, "cleanrl_flags": a.cleanrl_flags,
             "leanrl_flags": a.leanrl_flags}
    results = {**setup, "seed": a.seed, **got, "startup_s": startup_s,
               "process_wall_s": round(time.perf_counter() - t0, 1),
               "load_before": load_before, "load_after": loadavg(), "env_note": ENV_NOTE,
               "curve": {k: [p.get(k) for p in points] for k in ("env_steps", "env_steps_actual", "wall_s",
                                                                  "launch_s", "eval_return", "eval_s")}}
    last = points[-1] if points else {}
    figs = {k: schema.figure(v, u, h) for k, v, u, h in
            (("final_eval_return", last.get("eval_return"), "return", True), ("wall_s", last.get("wall_s"), "s", False),
             ("startup_s", startup_s, "s", False))
            if isinstance(v, (int, float)) and math.isfinite(v)}
    doc = schema.make("vs_cleanrl_part", schema.header("cpu", 1, setup), figs, results)
    path = write_json(Path(a.out) / "vs_cleanrl" / f"{name}.json", doc)
    print(f"vs_cleanrl: {name}: {len(points)} eval points, last {last.get('eval_return')} at "
          f"{last.get('env_steps')} env steps, {last.get('wall_s')} s training, {last.get('launch_s')} s from launch "
          f"-> {path}")
    return path


# -- merge -----------------------------------------------------------------------------------------------

def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def first_solved(curve: dict[str, list], goal: float) -> dict[str, Any] | None:
    """One seed's first eval point whose return reaches ``goal``: its env steps and both clocks."""
    for i, r in enumerate(curve["eval_return"]):
        if r is not None and r >= goal:
            return {"env_steps": curve["env_steps"][i], "wall_s": curve["wall_s"][i],
                    "launch_s": (curve.get("launch_s") or [None] * len(curve["env_steps"]))[i]}
    return None


def aggregate(parts: list[dict], goal: float | None = None) -> dict[str, Any]:
    """One (task, label)'s seeds -> mean and std (over seeds, ddof 0) at the eval points all seeds have; with
    ``goal``, each seed's time to reach it and their mean (when every seed did)."""
    # parts written before a flag existed ran without it
    base = {"cleanrl_flags": "", "leanrl_flags": "", "label": parts[0]["header"]["config"]["system"]}
    setups = {json.dumps({**base, **p["header"]["config"]}, sort_keys=True) for p in parts}
    if len(setups) > 1:
        raise ValueError(f"parts of one task and label ran with different setups: {sorted(setups)}")
    curves = [p["results"]["curve"] for p in parts]
    steps = sorted(set.intersection(*(set(c["env_steps"]) for c in curves)))
    out: dict[str, Any] = {"seeds": sorted(p["results"]["seed"] for p in parts), "env_steps": steps,
                           "return_mean": [], "return_std": [], "wall_s_mean": [], "wall_s_std": []}
    clocks = [("return", "eval_return"), ("wall_s", "wall_s")]
    if all(c.get("launch_s") and None not in c["launch_s"] for c in curves):
        out.update(launch_s_mean=[], launch_s_std=[])
        clocks.append(("launch_s", "launch_s"))
    for step in steps:
        at = [c["env_steps"].index(step) for c in curves]
        for key, col in clocks:
            m, sd = mean_std([c[col][i] for c, i in zip(curves, at)])
            out[f"{key}_mean"].append(round(m, 3))
            out[f"{key}_std"].append(round(sd, 3))
    first = parts[0]["results"]
    out.update(system=first["system"], env_id=first["env_id"], command=first["command"],
               versions=first.get("versions", {}), startup_s=[p["results"].get("startup_s") for p in parts],
               loads=[[p["results"]["load_before"], p["results"]["load_after"]] for p in parts])
    if goal is not None:
        solved = [first_solved(c, goal) for c in curves]
        out["solved"] = [{"seed": p["results"]["seed"], **(x or {})} for p, x in zip(parts, solved)]
        out["time_to_solve"] = None if None in solved else {
            key: None if any(x[key] is None for x in solved) else round(mean_std([x[key] for x in solved])[0], 3)
            for key in ("env_steps", "wall_s", "launch_s")}
    return out


def at_step(agg: dict[str, Any], step: int) -> float | None:
    return agg["return_mean"][agg["env_steps"].index(step)] if step in agg["env_steps"] else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def targets(peer: dict[str, Any], ours: dict[str, Any], env_steps: int, name: str = "hpcrl") -> dict[str, Any]:
    """The targets of one label (``name``) against CleanRL: returns at half and all of the budget; its wall time
    to CleanRL's final mean return over CleanRL's wall time for the budget (when CleanRL's final is above its first
    eval); where both have a time to solve (:func:`aggregate`), both and CleanRL's over ours on each clock."""
    out: dict[str, Any] = {}
    if "time_to_solve" in peer and "time_to_solve" in ours:
        c, h = peer["time_to_solve"] or {}, ours["time_to_solve"] or {}
        out["time_to_solve"] = {**{f"cleanrl_{k}": c.get(k) for k in ("env_steps", "wall_s", "launch_s")},
                                **{f"{name}_{k}": h.get(k) for k in ("env_steps", "wall_s", "launch_s")},
                                "speedup": _ratio(c.get("wall_s"), h.get("wall_s")),
                                "speedup_from_launch": _ratio(c.get("launch_s"), h.get("launch_s"))}
    for step in (env_steps // 2, env_steps):
        c, h = at_step(peer, step), at_step(ours, step)
        out[f"at_{step}"] = {"cleanrl": c, name: h, f"{name}_minus_cleanrl": None if c is None or h is None
                             else round(h - c, 3)}
    # a goal CleanRL's own first eval meets already (a short run) would time hpcrl's untrained policy
    if len(peer["env_steps"]) > 1 and ours["env_steps"] and peer["return_mean"][-1] > peer["return_mean"][0]:
        goal, peer_wall = peer["return_mean"][-1], peer["wall_s_mean"][-1]
        reach = next((w for r, w in zip(ours["return_mean"], ours["wall_s_mean"]) if r >= goal), None)
        out["time_to_cleanrl_final"] = {"cleanrl_final_return": goal, "cleanrl_wall_s": peer_wall,
                                        f"{name}_wall_s": reach,
                                        "ratio": None if reach is None else round(reach / peer_wall, 3)}
    return out


def merge_figures(tasks: dict[str, dict]) -> dict[str, dict]:
    """``<task>_<target>_<name>`` for the label ``hpcrl``, ``<task>_<label>_<target>_<name>`` for the others."""
    figs = {}
    for task, t in tasks.items():
        for label, tgts in t.get("targets", {}).items():
            prefix = task if label == "hpcrl" else f"{task}_{label}"
            for key, tgt in tgts.items():
                for name, v in tgt.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        better = not name.endswith(("_s", "env_steps")) and name != "ratio"
                        unit = ("s" if name.endswith("_s") else "env steps" if name.endswith("env_steps")
                                else "x" if name in ("ratio", "speedup", "speedup_from_launch") else "return")
                        figs[f"{prefix}_{key}_{name}"] = schema.figure(v, unit, better)
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
        groups.setdefault(r["task"], {}).setdefault(r.get("label", r["system"]), []).append(doc)
    tasks: dict[str, dict] = {}
    for task, labels in sorted(groups.items()):
        tasks[task] = {label: aggregate(parts, SOLVED.get(task)) for label, parts in sorted(labels.items())}
        if "cleanrl" in labels:
            budget = labels["cleanrl"][0]["results"]["env_steps"]
            tasks[task]["targets"] = {label: targets(tasks[task]["cleanrl"], tasks[task][label], budget, label)
                                      for label in sorted(labels) if label != "cleanrl"}
    peers = {name: {"repo": peer.repo, "commit": peer.commit, "files": peer.files} for name, peer in PEERS.items()
             if any(name in {agg.get("system") for agg in t.values()} for t in tasks.values())}
    results = {"tasks": tasks, "parts": [p.name for p in paths], "env_note": ENV_NOTE, "png": "vs_cleanrl.png",
               "solved": {"returns": SOLVED, "criterion": "a seed's first eval point (mean deterministic return "
                          "over the eval episodes) at or above the return; a label's time: the mean over its "
                          "seeds when every seed solved; clocks: training (evals out) and from launch (evals out)"},
               "peer": peers.get("cleanrl"), "peers": peers}
    doc = schema.make("vs_cleanrl", schema.header("cpu", 1, {"parts": len(paths)}), merge_figures(tasks), results)
    errs = schema.validate(doc)
    if errs:
        raise ValueError(f"vs_cleanrl: {errs}")
    path = write_json(out / "vs_cleanrl.json", doc)
    plot(tasks, out / "vs_cleanrl.png", doc["header"])
    print(f"vs_cleanrl: merged {len(paths)} parts -> {path}, {out / 'vs_cleanrl.png'}")
    return path


NAMES = {"cleanrl": "CleanRL SAC", "leanrl": "LeanRL SAC (compiled)", "hpcrl": "hpcrl FastSAC"}


def plot(tasks: dict[str, dict], png: Path, header: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(17, 4.2 * len(tasks)), squeeze=False)
    for row, (task, labels) in zip(axes, tasks.items()):
        for label, agg in labels.items():
            if label == "targets" or not agg["env_steps"]:
                continue
            name = NAMES.get(agg.get("system", label), label) + (f" [{label}]" if label != agg.get("system") else "")
            text = f"{name} ({agg['env_id']}, seeds {agg['seeds']})"
            m, sd = agg["return_mean"], agg["return_std"]
            line, = row[0].plot(agg["env_steps"], m, marker="o", label=text)
            row[0].fill_between(agg["env_steps"], [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                                color=line.get_color(), alpha=0.2)
            for ax, clock in ((row[1], "wall_s"), (row[2], "launch_s")):
                if f"{clock}_mean" in agg:
                    ax.errorbar(agg[f"{clock}_mean"], m, xerr=agg[f"{clock}_std"], yerr=sd, marker="o", capsize=3,
                                color=line.get_color(), label=text)
        row[0].set_xlabel("env steps")
        row[1].set_xlabel("training wall seconds (evals excluded)")
        row[2].set_xlabel("wall seconds from launch (evals excluded)")
        for ax in row:
            ax.set_ylabel(f"{task}: deterministic eval return")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    loads = [x[0] for t in tasks.values() for label, agg in t.items() if label != "targets"
             for pair in agg.get("loads", []) for x in pair if x]  # 1-minute load averages before and after each part
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    fig.suptitle(f"hpcrl vs CleanRL-family SAC, mean ± std over seeds; {header['cpu_model']} ({header['cpu_count']} "
                 f"cores{load}), {header['date'][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- command line ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="halfcheetah")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", choices=("cleanrl", "leanrl", "hpcrl"))
    p.add_argument("--label", default="", help="the part's name in the merge (default: the system), e.g. hpcrl-compile")
    p.add_argument("--env-steps", type=int, default=50_000)
    p.add_argument("--eval-every", type=int, default=5_000, help="env steps between evals")
    p.add_argument("--eval-episodes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads of either system")
    p.add_argument("--hpcrl-preset", default="", help="default: halfcheetah (pendulum for --quick)")
    p.add_argument("--hpcrl-flags", default="", help="more `python -m hpcrl.sac` flags (before the protocol's)")
    p.add_argument("--cleanrl-flags", default="", help="more CleanRL script flags (after its defaults' CLI)")
    p.add_argument("--leanrl-flags", default="", help="more LeanRL script flags (after its defaults' CLI)")
    for peer in (CLEANRL, LEANRL):
        p.add_argument(peer.flag, default=None, help=f"a checkout of {peer.repo} at the pinned commit "
                       f"(default: ${peer.env_var}, else the cache, fetched into when empty)")
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
        p.error("--system cleanrl|leanrl|hpcrl is required (or --merge)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        merge(Path(a.out))
        return 0
    try:
        run_part(a)
    except PeerSourceError as e:
        print(f"vs_cleanrl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
