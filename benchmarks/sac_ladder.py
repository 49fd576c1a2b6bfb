#!/usr/bin/env python
"""FastSAC update ladder: updates/s of ``FastSAC.update`` per rung, the rungs timed interleaved.

    python benchmarks/sac_ladder.py [--quick] [--json PATH]

Rungs (``SACConfig`` fields): ``per_head`` (per-head critic, per-parameter tensors: the old path),
``flat`` (flat parameters only: the default), ``batched`` (batched critic only), ``batched_flat`` (both),
``compiled`` (flat + ``--compile``: the whole update captured by torch.compile, hpcrl/sac/compiled.py; its
one-time compile is done before timing and reported as ``compile_s``).
Sizes: the pendulum preset (obs 3, action 1, batch 256, hidden 128) and the halfcheetah preset (obs 17,
action 6, batch 4096, critic 512, actor 256). One torch thread, CPU, one process. Every rung starts
from the same seed (hence the same weights) and runs on the same fixed batch and noise; one timed call
is ``policy_frequency`` updates (one actor step among them). Repeats of all rungs are interleaved
(benchmarks/_timing.py), so load from other processes hits every rung alike: compare ratios, not
absolute figures. Under load the process CPU time per update (``cpu_update_s``) is the steadier
measure on one thread: it does not count the time the process waited for a core. The JSON follows
benchmarks/schema.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import fmt_time, loadavg, machine_info, measure_group, print_table, write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import schema  # noqa: E402
from hpcrl.comm import Plane  # noqa: E402
from hpcrl.replay import Batch  # noqa: E402
from hpcrl.sac import FastSAC, UpdateNoise, preset  # noqa: E402

CPU = torch.device("cpu")
RUNGS: dict[str, dict[str, bool]] = {
    "per_head": dict(flat_params=False, batched_critic=False),
    "flat": dict(flat_params=True, batched_critic=False),
    "batched": dict(flat_params=False, batched_critic=True),
    "batched_flat": dict(flat_params=True, batched_critic=True),
    "compiled": dict(flat_params=True, batched_critic=False, compile=True),
}
SIZES = {"pendulum": (3, 1), "halfcheetah": (17, 6)}  # (obs_dim, action_dim) of each preset's env
BASE = "per_head"


def fixed_batch(batch: int, obs_dim: int, action_dim: int) -> tuple[Batch, UpdateNoise]:
    g = torch.Generator().manual_seed(1)
    data = Batch(obs=torch.randn(batch, obs_dim, generator=g), action=torch.rand(batch, action_dim, generator=g) * 2 - 1,
                 reward=torch.randn(batch, generator=g), next_obs=torch.randn(batch, obs_dim, generator=g),
                 discount=(torch.rand(batch, generator=g) > 0.01).float() * 0.99, n=torch.ones(batch, dtype=torch.int64))
    return data, UpdateNoise.draw(batch, action_dim, g, CPU)


def rung_call(name: str, rung: dict[str, bool], batch: int | None, compile_s: dict[str, float]) -> Callable[[], None]:
    cfg = preset(name, **rung, **({} if batch is None else {"batch_size": batch}))
    obs_dim, action_dim = SIZES[name]
    torch.manual_seed(0)
    agent = FastSAC(cfg, obs_dim, action_dim, -torch.ones(action_dim), torch.ones(action_dim), CPU,
                    plane=Plane.local("device"))
    data, noise = fixed_batch(cfg.batch_size, obs_dim, action_dim)

    def call() -> None:
        for _ in range(cfg.policy_frequency):
            agent.update(data, noise)
    if agent._compiled is not None:  # compile (critic and actor parts) outside the timed calls
        call()
        compile_s["compiled"] = agent._compiled.compile_s
    return call


def bench_size(name: str, repeats: int, min_repeat_s: float, batch: int | None) -> dict[str, Any]:
    cfg = preset(name, **({} if batch is None else {"batch_size": batch}))
    compile_s: dict[str, float] = {}
    calls = {rung: rung_call(name, flags, batch, compile_s) for rung, flags in RUNGS.items()}
    load_before = loadavg()
    timed = measure_group(calls, CPU, warmup=2, repeats=repeats, min_repeat_s=min_repeat_s, max_inner=200)
    per_update = {rung: t["median_s"] / cfg.policy_frequency for rung, t in timed.items()}
    cpu = {rung: t["cpu_median_s"] / cfg.policy_frequency for rung, t in timed.items()}
    return {
        "batch_size": cfg.batch_size, "critic_hidden": cfg.critic_hidden, "actor_hidden": cfg.actor_hidden,
        "num_q": cfg.num_q, "num_atoms": cfg.num_atoms, "obs_dim": SIZES[name][0], "action_dim": SIZES[name][1],
        "updates_per_call": cfg.policy_frequency, "loadavg_before": load_before, "loadavg_after": loadavg(),
        "rungs": {rung: {**RUNGS[rung], "update_s": s, "updates_per_s": 1.0 / s, "speedup_vs_per_head": per_update[BASE] / s,
                         "cpu_update_s": cpu[rung], "cpu_speedup_vs_per_head": cpu[BASE] / cpu[rung],
                         "min_update_s": timed[rung]["min_s"] / cfg.policy_frequency, "cpu_frac": timed[rung]["cpu_frac"],
                         "inner": timed[rung]["inner"], "repeats": repeats,
                         **({"compile_s": compile_s[rung]} if rung in compile_s else {})}
                  for rung, s in per_update.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="few, short repeats; halfcheetah at batch 1024")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats, min_repeat_s = (3, 0.05) if args.quick else (9, 0.3)
    default = "sac_ladder_quick.json" if args.quick else "sac_ladder.json"
    out_path = args.json or Path(__file__).resolve().parent / "results" / default
    sizes = {"pendulum": bench_size("pendulum", repeats, min_repeat_s, None),
             "halfcheetah": bench_size("halfcheetah", repeats, min_repeat_s, 1024 if args.quick else None)}
    rows = [[name, rung, fmt_time(r["update_s"]), f"{r['updates_per_s']:.1f}", f"{r['speedup_vs_per_head']:.2f}x",
             fmt_time(r["cpu_update_s"]), f"{r['cpu_speedup_vs_per_head']:.2f}x", f"{r['cpu_frac']:.2f}"] for name, size in sizes.items() for rung, r in size["rungs"].items()]
    print_table("FastSAC.update, 1 thread, rungs interleaved (median)",
                ["preset", "rung", "update", "updates/s", "vs per_head", "CPU time", "vs per_head (CPU)", "cpu_frac"],
                rows)
    figures = {f"{name}_{rung}_update_s": schema.figure(r["update_s"], "s", False)
               for name, size in sizes.items() for rung, r in size["rungs"].items()}
    figures.update({f"{name}_speedup_batched_flat": schema.figure(size["rungs"]["batched_flat"]["speedup_vs_per_head"],
                                                                  "x", True) for name, size in sizes.items()})
    # compiled vs the default eager path (flat), by wall and by process CPU time (the steadier under load)
    for name, size in sizes.items():
        r = size["rungs"]
        figures[f"{name}_compiled_vs_flat"] = schema.figure(r["flat"]["update_s"] / r["compiled"]["update_s"], "x", True)
        figures[f"{name}_compiled_vs_flat_cpu"] = schema.figure(r["flat"]["cpu_update_s"] / r["compiled"]["cpu_update_s"],
                                                               "x", True)
        figures[f"{name}_compile_s"] = schema.figure(r["compiled"]["compile_s"], "s", False)
    config = {"quick": args.quick, "repeats": repeats, "min_repeat_s": min_repeat_s, "threads": 1,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    results = {"machine": machine_info(CPU, 1), "sizes": sizes,
               "note": "ratios are what counts: the machine may be shared (see loadavg and cpu_frac)"}
    path = write_json(out_path, schema.make("sac_ladder", schema.header("cpu", 1, config), figures, results))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
