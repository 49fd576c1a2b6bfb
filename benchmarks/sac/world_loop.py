#!/usr/bin/env python
"""Two ranks against one in the whole FastSAC training loop, as a user runs it: per-update wall time of
``python -m hpcrl.sac --preset pendulum --nproc 1`` and ``--nproc 2`` (the same global batch and envs, split
over the ranks), rounds of the two interleaved.

    python benchmarks/sac/world_loop.py [--rounds 5] [--env-steps 6000] [--json PATH] [--quick]

Each run steps, samples, updates, averages gradients and logs as the preset does (evals and checkpoints off);
the time per update is read from its ``metrics.jsonl``: (time, updates) of the last row minus those of the
first row at or past ``--from-env-steps``, over the updates between (start-up, warm-up and the first
updates are outside that window). sac_ladder.py ``--world`` times the update alone; this is the loop around
it too (env steps, replay writes, the policy's actions, logging). One torch thread per rank; the 2-rank run
uses both cores of a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
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

PRESET = ["--preset", "pendulum", "--checkpoint-every", "0", "--eval-episodes", "0", "--threads", "1"]


def per_update_s(rows: list[dict], from_env_steps: int) -> tuple[float, int]:
    """Seconds per update between the first row at or past ``from_env_steps`` and the last row; the updates."""
    rows = [r for r in rows if r.get("updates") is not None and "eval_return" not in r]
    first = next(r for r in rows if r["env_steps"] >= from_env_steps)
    last = rows[-1]
    updates = last["updates"] - first["updates"]
    if updates <= 0:
        raise ValueError(f"no updates after {from_env_steps} env steps")
    return (last["time"] - first["time"]) / updates, updates


def run(nproc: int, env_steps: int, from_env_steps: int, work: Path, extra: list[str]) -> dict[str, float]:
    run_dir = work / f"w{nproc}"
    cmd = [sys.executable, "-m", "hpcrl.sac", *PRESET, "--nproc", str(nproc), "--total-env-steps", str(env_steps),
           *extra, "--run-dir", str(run_dir), "--overwrite"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"world_loop: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s, updates = per_update_s(rows, from_env_steps)
    return {"update_s": s, "updates_timed": updates, "process_s": wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--env-steps", type=int, default=6000)
    ap.add_argument("--from-env-steps", type=int, default=1000, help="the timed window starts at this env step")
    ap.add_argument("--flags", default="", help="more `python -m hpcrl.sac` flags for both, e.g. --compile")
    ap.add_argument("--quick", action="store_true", help="1 round of short runs (a check that it works)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/world_loop.json (none with --quick)")
    a = ap.parse_args(argv)
    rounds, env_steps, start = (1, 640, 320) if a.quick else (a.rounds, a.env_steps, a.from_env_steps)
    extra = a.flags.split()
    load_before = loadavg()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="world_loop_") as tmp:
        for _ in range(rounds):
            for nproc in (1, 2):
                runs[nproc].append(run(nproc, env_steps, start, Path(tmp), extra))
    med = {n: statistics.median(r["update_s"] for r in rs) for n, rs in runs.items()}
    ratios = [b["update_s"] / a_["update_s"] for a_, b in zip(runs[1], runs[2])]
    summary = {"w1_update_s": med[1], "w2_update_s": med[2], "w2_over_w1": med[2] / med[1],
               "w2_over_w1_per_round": ratios, "target": 0.8}
    config = {"rounds": rounds, "env_steps": env_steps, "from_env_steps": start, "flags": PRESET + extra}
    figures = {"pendulum_loop_w1_update_s": schema.figure(med[1], "s", False),
               "pendulum_loop_w2_update_s": schema.figure(med[2], "s", False),
               "pendulum_loop_w2_over_w1": schema.figure(med[2] / med[1], "x", False)}
    doc = schema.make("world_loop", schema.header("cpu", 2, config), figures,
                      {"runs": {f"w{n}": rs for n, rs in runs.items()}, "summary": summary,
                       "load_before": load_before, "load_after": loadavg()})
    print(f"whole loop, pendulum preset: W=1 {med[1] * 1e3:.2f} ms/update, W=2 {med[2] * 1e3:.2f} ms/update: "
          f"{med[2] / med[1]:.3f}x (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    path = a.json or (None if a.quick else str(RESULTS / "world_loop.json"))
    if path:
        write_json(path, doc)
        print(f"world_loop: {path}")
    return doc


if __name__ == "__main__":
    main()
