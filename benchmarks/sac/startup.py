#!/usr/bin/env python
"""Start-up as a user meets it: from launching ``python -m hpcrl.sac`` (and a detached PPO run) to its first
update, and to its exit, rounds interleaved across the configurations.

    python benchmarks/sac/startup.py [--rounds 5] [--baseline DIR] [--json PATH] [--quick]

FastSAC at the pendulum preset on 1 and 2 local ranks, eager and ``--compile`` (the compiled update loaded from
a graph store warmed by an untimed run first, as every run after a user's first), and detached PPO on
CartPole with 1 maker and 1 trainer. Each run learns from its first vector steps (``--learning-starts`` and
``--random-steps`` at their minimum) for a few hundred env steps; the first update is the first
``metrics.jsonl`` row with ``updates`` > 0 (every vector step logs one), read by polling the file every 5 ms.
The child's environment is the caller's (no ``OMP_NUM_THREADS`` unless set): what a user's shell gives.
``--baseline DIR``: a checkout of another commit (its ``hpcrl._C`` built or copied in), whose hpcrl the same
runs import, interleaved with this one's in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, write_json  # noqa: E402

SAC = ["--preset", "pendulum", "--learning-starts", "1", "--random-steps", "1", "--log-every", "1",
       "--checkpoint-every", "0", "--eval-episodes", "0"]
CONFIGS = {  # name -> (module, flags)
    "sac_1_rank": ("hpcrl.sac", [*SAC]),
    "sac_1_rank_compile": ("hpcrl.sac", [*SAC, "--compile"]),
    "sac_2_ranks": ("hpcrl.sac", [*SAC, "--nproc", "2"]),
    "sac_2_ranks_compile": ("hpcrl.sac", [*SAC, "--nproc", "2", "--compile"]),
    "ppo_cartpole_1_1": ("hpcrl.ppo", ["--workload", "cartpole", "--makers", "1", "--trainers", "1",
                                       "--checkpoint-every", "0"]),
}
STEPS = {"hpcrl.sac": ["--total-env-steps", "640"], "hpcrl.ppo": ["--total-steps", "3"]}
QUICK_STEPS = {"hpcrl.sac": ["--total-env-steps", "96", "--num-envs", "16", "--batch-size", "64"],
               "hpcrl.ppo": ["--total-steps", "1"]}


def first_update(metrics: Path) -> bool:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if (json.loads(line).get("updates") or 0) > 0:
                return True
        except ValueError:  # a row being written
            return False
    return False


REPO = Path(__file__).resolve().parents[2]


def launch(module: str, flags: list[str], work: Path, cache: Path, tree: Path) -> dict[str, float]:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)  # the previous round's rows must not count
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": path}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, *flags, "--run-dir", str(run)],
                            cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and first_update(run / "metrics.jsonl"):
            first = time.perf_counter() - t0
        time.sleep(0.005)
    total = time.perf_counter() - t0
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"startup: {module} {' '.join(flags)} exited {proc.returncode}:\n{err[-2000:]}")
    if first is None and first_update(run / "metrics.jsonl"):
        first = total  # the run ended between two looks
    if first is None:
        raise SystemExit(f"startup: {module} {' '.join(flags)} logged no update")
    return {"first_update_s": first, "exit_s": total}


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smaller runs, 1 round (a check that it works)")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, timed beside this one")
    ap.add_argument("--json", default=str(RESULTS / "startup.json"))
    args = ap.parse_args()
    trees = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rounds = 1 if args.quick else args.rounds
    steps = QUICK_STEPS if args.quick else STEPS
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {name: [] for name in CONFIGS} for t in trees}
        for t, tree in trees.items():  # untimed: fills each tree's compile graph store and the page cache
            for name, (module, flags) in CONFIGS.items():
                work = Path(tmp, t, name)
                work.mkdir(parents=True)
                launch(module, [*flags, *steps[module]], work, Path(tmp, t, "inductor"), tree)
        for _ in range(rounds):
            for name, (module, flags) in CONFIGS.items():
                for t, tree in trees.items():
                    runs[t][name].append(launch(module, [*flags, *steps[module]], Path(tmp, t, name),
                                                Path(tmp, t, "inductor"), tree))
    medians = {t: {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in by.items()}
               for t, by in runs.items()}
    config = {"rounds": rounds, "quick": args.quick, "configs": {n: [m, *f, *steps[m]] for n, (m, f) in CONFIGS.items()},
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "trees": {t: _commit(tree) for t, tree in trees.items()}}
    figures = {f"{'' if t == 'this' else t + '_'}{name}_{k}": schema.figure(v, "s", False)
               for t, by in medians.items() for name, m in by.items() for k, v in m.items()}
    doc = schema.make("startup", schema.header("cpu", 1, config), figures,
                      {"runs": runs, "medians": medians, "load_before": load_before, "load_after": loadavg()})
    write_json(args.json, doc)
    print(f"{'configuration':<22} {'launch to first update':>24} {'launch to exit':>16}   (median of {rounds})")
    for name in CONFIGS:
        for t in trees:
            m = medians[t][name]
            print(f"{name + ('' if t == 'this' else ' (baseline)'):<33} {m['first_update_s']:>11.2f} s "
                  f"{m['exit_s']:>14.2f} s")
    print(f"startup: {args.json}")


if __name__ == "__main__":
    main()
