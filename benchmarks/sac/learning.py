#!/usr/bin/env python
"""FastSAC learning curves on real tasks, next to the CleanRL-style SAC a user would otherwise write.

    python benchmarks/sac/learning.py [--quick] [--budget-min M] [--playground-min M] [--hc-flags "..."]
                                  [--skip-halfcheetah] [--skip-playground] [--out DIR]

1. HalfCheetah: ``python -m hpcrl.sac --preset halfcheetah`` (1 rank, public CLI, a subprocess) with
   ``--hc-flags`` on top (default ``--batch-size 512``: the preset's global batch of 4096 reached only
   ~26 env steps/s on this 2-core machine), stopped by SIGTERM after ``--budget-min`` minutes (hpcrl.sac
   checkpoints and exits 75; the curve is what metrics.jsonl holds: training episode returns every
   ``--log-every`` and deterministic ``eval_return`` rows every ``--eval-every`` vector steps).
   Then the baseline, in this process, for the SAME number of env steps FastSAC reached (equal samples):
   ``benchmarks/sac/cleanrl_style_sac.py`` (CleanRL-style eager SAC with the same networks, losses and
   schedule, checked against hpcrl's update by benchmarks/sac/sac_throughput.py) driven by a CleanRL-style
   loop (numpy replay of obs and next_obs, numpy episode bookkeeping) with the SAME hyper-parameters
   (the resolved SACConfig of the FastSAC run), on the same env adapter (``hpcrl.envs.make_env``), with
   the same evaluation schedule (``hpcrl.envs.first_episode_returns``, deterministic tanh(mean) actions).
   So the two differ in implementation, not in algorithm: at equal samples their returns should agree
   up to seed noise, and the wall time is the difference.
2. Playground: ``python -m hpcrl.sac --preset playground`` (DM-suite CartpoleBalance) for ``--playground-min``.
3. ``learning_halfcheetah.json`` / ``.png`` and ``learning_playground.json`` / ``.png`` in ``--out``
   (common schema: benchmarks/common/schema.py). The HalfCheetah PNG draws CleanRL's published SAC score
   (9634.89 +- 1423.73 on HalfCheetah-v4 at 1M steps, mean of the last 100 training episodes, 3 seeds;
   CleanRL's docs/benchmark pages, see docs/envs.md) as a reference line only: 1M samples on other
   hardware, with CleanRL's own hyper-parameters (UTD 1, batch 256) — not comparable in samples.

``--quick`` (CI, seconds): tiny networks, a few hundred env steps, each run to its end (no SIGTERM);
JSON to ``--out`` (default a temp dir under --quick, else benchmarks/results).
Timings here are on a shared 2-core machine (other jobs may run): wall time and steps/s are what this
machine gave at that moment; the JSON records the load average before and after each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)  # cleanrl_style_sac
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cleanrl_style_sac import CleanRLStyleLoop  # noqa: E402

from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, write_json  # noqa: E402
from hpcrl.envs import first_episode_returns, make_env  # noqa: E402
from hpcrl.sac.config import SACConfig  # noqa: E402

CLEANRL_PUBLISHED = {"value": 9634.89, "std": 1423.73, "env": "HalfCheetah-v4", "env_steps": 1_000_000,
                     "metric": "mean of the last 100 training episodes, 3 seeds",
                     "source": "CleanRL docs/benchmark (sac_continuous_action.py), see docs/envs.md",
                     "note": "other hardware, CleanRL's hyper-parameters (1 env, UTD 1, batch 256); not comparable in samples"}
HC_FLAGS = "--batch-size 512"
HC_EVAL = ["--eval-every", "1000", "--eval-episodes", "4"]  # 1000 vector steps = 16,000 transitions at 16 envs
QUICK_HC = ("--num-envs 2 --batch-size 32 --buffer-size 256 --actor-hidden 16 --critic-hidden 16 --num-atoms 11 "
            "--learning-starts 8 --random-steps 8 --log-every 8 --total-env-steps 96")
QUICK_HC_EVAL = ["--eval-every", "24", "--eval-episodes", "1"]
QUICK_PG = ("--num-envs 4 --batch-size 32 --buffer-size 64 --actor-hidden 16 --critic-hidden 16 --num-atoms 11 "
            "--learning-starts 4 --random-steps 4 --log-every 8 --total-env-steps 64")
QUICK_PG_EVAL = ["--eval-every", "8", "--eval-episodes", "1"]


# -- FastSAC through the public CLI --------------------------------------------------------------------

def run_fastsac(preset: str, flags: list[str], run_dir: Path, budget_s: float | None) -> dict[str, Any]:
    """``python -m hpcrl.sac --preset P ...`` until it ends or ``budget_s`` passes (then SIGTERM: hpcrl
    checkpoints and exits 75). Returns the curves read from metrics.jsonl."""
    cmd = [sys.executable, "-m", "hpcrl.sac", "--preset", preset, "--run-dir", str(run_dir),
           "--checkpoint-every", "0", *flags]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    load_before = loadavg()
    t0 = time.perf_counter()
    stopped = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    if proc.returncode not in (0, 75):
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    train_rows = [r for r in rows if "eval_return" not in r]
    eval_rows = [r for r in rows if "eval_return" in r and r["eval_return"] is not None]
    episodes = [(r["env_steps"], r["episode_return"], r.get("time")) for r in train_rows
                if r.get("episode_return") is not None]
    env_steps = max((r["env_steps"] for r in rows), default=0)
    for line in text.splitlines():  # a stop mid-window: the checkpoint's env step is past the last row
        if "checkpoint at env step" in line:
            env_steps = max(env_steps, int(line.split("checkpoint at env step", 1)[1].split()[0]))
    last = train_rows[-1] if train_rows else {}
    train_s = float(last.get("time") or seconds)
    return {
        "command": shlex.join(["python", *cmd[1:]]), "returncode": proc.returncode, "stopped_by_budget": stopped,
        "wall_s": round(seconds, 1), "train_s_at_last_row": round(train_s, 1), "env_steps": env_steps,
        "updates_at_last_row": last.get("updates"),
        "env_steps_per_s": round(last.get("env_steps", 0) / max(train_s, 1e-9), 1),
        "updates_per_s": round((last.get("updates") or 0) / max(train_s, 1e-9), 2),
        "train_curve": {"env_steps": [e[0] for e in episodes], "episode_return": [round(e[1], 2) for e in episodes],
                        "time_s": [e[2] for e in episodes]},
        "eval_curve": {"env_steps": [r["env_steps"] for r in eval_rows],
                       "eval_return": [round(r["eval_return"], 2) for r in eval_rows],
                       "time_s": [r.get("time") for r in eval_rows]},
        "final_train_return": round(episodes[-1][1], 2) if episodes else None,
        "final_eval_return": round(eval_rows[-1]["eval_return"], 2) if eval_rows else None,
        "final_eval_env_steps": eval_rows[-1]["env_steps"] if eval_rows else None,
        "load_before": load_before, "load_after": loadavg(), "config": cfg,
    }


# -- the baseline: CleanRL-style SAC, same hyper-parameters, same number of env steps --------------------

def run_baseline(cfg: SACConfig, target_env_steps: int, max_s: float, seed: int) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    loop = CleanRLStyleLoop(cfg, make_env(cfg.env, cfg.num_envs, "cpu", seed=seed), seed=seed)
    eval_n = max(1, cfg.eval_episodes)
    train_curve: dict[str, list] = {"env_steps": [], "episode_return": [], "time_s": []}
    eval_curve: dict[str, list] = {"env_steps": [], "eval_return": [], "time_s": []}
    iterations = math.ceil(target_env_steps / cfg.num_envs)
    load_before = loadavg()

    def evaluate() -> float:
        eval_env = make_env(cfg.env, eval_n, "cpu", seed=seed + 1_000_003)

        @torch.no_grad()
        def act(o: torch.Tensor) -> torch.Tensor:
            mean, _ = loop.agent.actor(loop.normalize(o))
            return torch.tanh(mean) * loop.agent.actor.action_scale + loop.agent.actor.action_bias

        r = float(first_episode_returns(eval_env, eval_env.reset(seed=seed + 1_000_003), act).mean())
        eval_env.close() if hasattr(eval_env, "close") else None
        return r

    t0 = time.perf_counter()
    it = 0
    for it in range(iterations):
        loop.step()
        steps = (it + 1) * cfg.num_envs
        last = it + 1 == iterations
        if ((it + 1) % cfg.log_every == 0 or last) and loop.finished:
            train_curve["env_steps"].append(steps)
            train_curve["episode_return"].append(round(float(np.mean(loop.finished)), 2))
            train_curve["time_s"].append(round(time.perf_counter() - t0, 2))
            loop.finished.clear()
        if cfg.eval_every and ((it + 1) % cfg.eval_every == 0 or last) or (last and cfg.eval_episodes):
            eval_curve["env_steps"].append(steps)
            eval_curve["eval_return"].append(round(evaluate(), 2))
            eval_curve["time_s"].append(round(time.perf_counter() - t0, 2))
        if time.perf_counter() - t0 > max_s:
            break
    seconds = time.perf_counter() - t0
    steps = (it + 1) * cfg.num_envs
    updates = loop.updates
    return {
        "what": "benchmarks/sac/cleanrl_style_sac.py learner in a CleanRL-style loop, hyper-parameters of the FastSAC run",
        "target_env_steps": target_env_steps, "env_steps": steps, "reached_equal_samples": steps >= target_env_steps,
        "wall_s": round(seconds, 1), "updates": updates,
        "env_steps_per_s": round(steps / max(seconds, 1e-9), 1), "updates_per_s": round(updates / max(seconds, 1e-9), 2),
        "train_curve": train_curve, "eval_curve": eval_curve,
        "final_train_return": train_curve["episode_return"][-1] if train_curve["episode_return"] else None,
        "final_eval_return": eval_curve["eval_return"][-1] if eval_curve["eval_return"] else None,
        "final_eval_env_steps": eval_curve["env_steps"][-1] if eval_curve["env_steps"] else None,
        "note": "timings include the evaluations (as FastSAC's wall time does)",
        "load_before": load_before, "load_after": loadavg(),
    }


def _at(curve: dict[str, list], key: str, step: int | None) -> float | None:
    for x, y in zip(curve["env_steps"], curve[key]):
        if x == step:
            return y
    return None


def compare_at_equal_samples(fast: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Both runs at the same env step: FastSAC's last eval step (both evaluate on the same --eval-every
    grid) and the last training-return step both logged."""
    ev = fast["final_eval_env_steps"]
    common = sorted(set(fast["train_curve"]["env_steps"]) & set(base["train_curve"]["env_steps"]))
    tr = common[-1] if common else None
    out = {"eval_env_steps": ev, "fastsac_eval_return": _at(fast["eval_curve"], "eval_return", ev),
           "baseline_eval_return": _at(base["eval_curve"], "eval_return", ev),
           "train_env_steps": tr, "fastsac_train_return": _at(fast["train_curve"], "episode_return", tr),
           "baseline_train_return": _at(base["train_curve"], "episode_return", tr)}
    for kind in ("eval", "train"):
        a, b = out[f"fastsac_{kind}_return"], out[f"baseline_{kind}_return"]
        out[f"{kind}_diff_fastsac_minus_baseline"] = round(a - b, 2) if a is not None and b is not None else None
    return out


def config_of(run: dict[str, Any]) -> SACConfig:
    fields = {f.name for f in dataclasses.fields(SACConfig)}
    return dataclasses.replace(SACConfig(), **{k: v for k, v in run["config"].items() if k in fields})


# -- plots -------------------------------------------------------------------------------------------------

def plot(runs: dict[str, dict[str, Any]], png: Path, title: str, reference: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, run in runs.items():
        for ax, key in zip(axes, ("env_steps", "time_s")):
            tc, ec = run["train_curve"], run["eval_curve"]
            xs = [x for x, t in zip(tc[key], tc["time_s"]) if x is not None and t is not None]
            ys = [y for y, t, x in zip(tc["episode_return"], tc["time_s"], tc[key]) if x is not None and t is not None]
            line, = ax.plot(xs, ys, marker=".", label=f"{name}: training episodes")
            exs = [x for x in ec[key] if x is not None]
            eys = [y for y, x in zip(ec["eval_return"], ec[key]) if x is not None]
            ax.plot(exs, eys, marker="*", ms=9, ls="--", color=line.get_color(),
                    label=f"{name}: deterministic eval")
    if reference is not None:
        for ax in axes:
            ax.axhline(reference["value"], color="gray", ls=":", lw=1.2,
                       label=f"CleanRL SAC published {reference['value']:.2f} at 1M steps ({reference['env']}, other "
                             "hardware; not comparable in samples)")
    axes[0].set_xlabel("env steps (transitions)")
    axes[1].set_xlabel("wall seconds since the run's start (this machine, shared)")
    for ax in axes:
        ax.set_ylabel("episode return")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7.5, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(textwrap.fill(title, 170), fontsize=8.5)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.13 if reference is not None else 0.08, 1, 0.95))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def titles(doc: dict[str, Any]) -> str:
    r, cfg = doc["results"], doc["header"]["config"]
    if "baseline_cleanrl_style" in r:
        fast, base = r["fastsac"], r["baseline_cleanrl_style"]
        return (f"HalfCheetah-v5, 1 CPU rank, --preset halfcheetah {shlex.join(cfg['hc_flags'])}; equal samples "
                f"({base['env_steps']} transitions); FastSAC {fast['wall_s']:.0f} s, CleanRL-style baseline "
                f"{base['wall_s']:.0f} s (shared 2-core machine)")
    pg = r["fastsac"]
    return (f"Playground CartpoleBalance, 1 CPU rank, --preset playground {shlex.join(cfg['pg_flags'])}; "
            f"{pg['env_steps']} transitions in {pg['wall_s']:.0f} s (max return 1000; shared 2-core machine)")


def replot(doc_path: Path) -> None:
    doc = json.loads(doc_path.read_text())
    r = doc["results"]
    runs = {"FastSAC (hpcrl)": r["fastsac"]}
    if "baseline_cleanrl_style" in r:
        runs["CleanRL-style SAC (same hyper-parameters)"] = r["baseline_cleanrl_style"]
    plot(runs, doc_path.with_suffix(".png"), titles(doc), r.get("cleanrl_published"))


def write_doc(name: str, out: Path, config: dict[str, Any], figs: dict[str, Any], results: dict[str, Any]) -> Path:
    doc = schema.make(name, schema.header("cpu", 1, config), figs, results)
    errs = schema.validate(doc)
    if errs:
        raise ValueError(f"{name}: {errs}")
    return write_json(out / f"{name}.json", doc)


def fig(value: Any, unit: str, higher: bool) -> dict[str, Any] | None:
    return schema.figure(value, unit, higher) if isinstance(value, (int, float)) and math.isfinite(value) else None


def run_figs(name: str, run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (final returns, rates, wall time), keyed ``NAME_FIELD``; fields it lacks are left out."""
    units = {"env_steps": ("transitions", True), "final_train_return": ("return", True),
             "final_eval_return": ("return", True), "env_steps_per_s": ("transitions/s", True),
             "updates_per_s": ("updates/s", True), "wall_s": ("s", False)}
    figs = {f"{name}_{key}": fig(run.get(key), unit, higher) for key, (unit, higher) in units.items()}
    return {k: f for k, f in figs.items() if f is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI: tiny sizes, seconds")
    p.add_argument("--budget-min", type=float, default=20.0, help="FastSAC HalfCheetah wall budget (minutes)")
    p.add_argument("--baseline-max-min", type=float, default=40.0,
                   help="stop the baseline after this many minutes even short of equal samples (recorded)")
    p.add_argument("--playground-min", type=float, default=6.0, help="FastSAC Playground wall budget (minutes)")
    p.add_argument("--hc-flags", default=None, help=f"extra hpcrl.sac flags for HalfCheetah (default {HC_FLAGS!r})")
    p.add_argument("--pg-flags", default="", help="extra hpcrl.sac flags for Playground")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-halfcheetah", action="store_true")
    p.add_argument("--skip-playground", action="store_true")
    p.add_argument("--quick-playground", action="store_true",
                   help="with --quick, run Playground too (its JAX compilation alone takes ~30-50 s here)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results; a temp dir with --quick)")
    p.add_argument("--work", default=None, help="run directories (default a temp dir)")
    p.add_argument("--replot", nargs="*", default=None, metavar="JSON", help="only redraw the PNGs of these JSON files")
    args = p.parse_args(argv)
    if args.replot is not None:
        for doc_path in args.replot:
            replot(Path(doc_path))
        return 0
    out = Path(args.out or (tempfile.mkdtemp(prefix="learning_quick_") if args.quick else RESULTS))
    work = Path(args.work or tempfile.mkdtemp(prefix="learning_runs_"))
    seed = ["--seed", str(args.seed)]
    common = {"argv": sys.argv[1:] if argv is None else argv, "quick": args.quick,
              "note": "shared 2-core CPU machine; other jobs may have run at the same time (see load_before/after)"}

    if not args.skip_halfcheetah:
        hc_flags = shlex.split(QUICK_HC if args.quick else (HC_FLAGS if args.hc_flags is None else args.hc_flags))
        flags = [*hc_flags, *(QUICK_HC_EVAL if args.quick else HC_EVAL), *seed]
        budget = None if args.quick else args.budget_min * 60
        print(f"learning: FastSAC HalfCheetah, budget {budget} s ...", flush=True)
        fast = run_fastsac("halfcheetah", flags, work / "halfcheetah_fastsac", budget)
        print(f"learning: FastSAC reached {fast['env_steps']} env steps in {fast['wall_s']} s; baseline ...", flush=True)
        base = run_baseline(config_of(fast), fast["env_steps"], 60.0 if args.quick else args.baseline_max_min * 60,
                            args.seed)
        print(f"learning: baseline {base['env_steps']} env steps in {base['wall_s']} s", flush=True)
        figs = {**run_figs("fastsac", fast), **run_figs("baseline", base)}
        results = {"env": "gym:HalfCheetah-v5", "fastsac": fast, "baseline_cleanrl_style": base,
                   "at_equal_samples": compare_at_equal_samples(fast, base),
                   "equal_samples": base["reached_equal_samples"], "cleanrl_published": CLEANRL_PUBLISHED,
                   "png": "learning_halfcheetah.png"}
        path = write_doc("learning_halfcheetah", out, {**common, "hc_flags": hc_flags}, figs, results)
        replot(path)
        print(f"learning: wrote {path}", flush=True)

    if not args.skip_playground and (args.quick_playground or not args.quick):
        pg_flags = shlex.split(QUICK_PG if args.quick else args.pg_flags)
        flags = [*pg_flags, *(QUICK_PG_EVAL if args.quick else []), *seed]
        budget = None if args.quick else args.playground_min * 60
        print(f"learning: FastSAC Playground CartpoleBalance, budget {budget} s ...", flush=True)
        pg = run_fastsac("playground", flags, work / "playground_fastsac", budget)
        figs = run_figs("fastsac", pg)
        results = {"env": "playground:CartpoleBalance", "fastsac": pg, "png": "learning_playground.png"}
        path = write_doc("learning_playground", out, {**common, "pg_flags": pg_flags}, figs, results)
        replot(path)
        print(f"learning: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
