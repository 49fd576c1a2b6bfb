#!/usr/bin/env python
"""Time to reward on the hf demo task with the makers' engine ``hf`` (transformers' generate) vs ``vllm``.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/hf/engines_learning.py [--quick] [--seed 0]
        # -> benchmarks/results/hf_engines_learning.json (needs vLLM: bash tools/setup_vllm_cpu.sh --new .venv-vllm)

The task and the GRPO budget are :mod:`hf_learning`'s (``hpcrl-grpo``: 16 prompts x 4 samples per update,
4 new tokens, 200 updates, 1 maker : 1 trainer, lag 1), on the demo model built for vLLM
(``python -m hpcrl.ppo.demo DIR --engine vllm``: attention heads of 32 features, which vLLM's CPU attention
runs; both engines run that same model). The engines run one after the other, ``hf`` first, in one
invocation. The target is TRL's final reward on the same seed, read from ``hf_learning.json`` (TRL ran the
default demo model: heads of 16).

Per engine: the reward curve, ``train_s`` (the run's clock from its first update), ``process_wall_s`` (launch
to exit), ``time_to_target_s`` (the run's clock when the 10-update moving average of the reward first reaches
the target) and ``launch_to_target_s`` = ``process_wall_s - train_s + time_to_target_s``: start-up (imports,
model loading, the vLLM engine's start) on the clock, plus the shutdown after the last update.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]
import hf_learning as L  # noqa: E402

from benchmarks.common.timing import loadavg, machine_info, write_json  # noqa: E402

ENGINES = ("hf", "vllm")


def target(seed: int, results: Path) -> float | None:
    """TRL's final reward on ``seed`` from hf_learning.json (None where it has none)."""
    try:
        return json.loads(results.read_text())["summary"]["target"]["reward_by_seed"].get(str(seed))
    except (OSError, KeyError, ValueError):
        return None


def summary(run: dict[str, Any], goal: float | None) -> dict[str, Any]:
    """One engine's figures (pure: from its run record)."""
    reached = None if goal is None else L.time_to(run, goal)
    startup = run["process_wall_s"] - run["train_s"]
    return {"reward_first": sum(r["reward"] for r in run["curve"][:5]) / len(run["curve"][:5]),
            "reward_last": L.final_reward(run), "eval_pass_last": run["eval"][-1]["eval_pass_rate"],
            "train_s": run["train_s"], "process_wall_s": run["process_wall_s"], "startup_and_shutdown_s": startup,
            "tokens_per_s": run["tokens_per_s"], "time_to_target_s": reached,
            "launch_to_target_s": None if reached is None else startup + reached}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a test: {L.QUICK}")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "hf-engines-learning", help="demo dir, runs, logs")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "hf_engines_learning.json")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per run")
    a = ap.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        L.fail("vLLM is not installed in this interpreter; run it with .venv-vllm/bin/python "
               "(bash tools/setup_vllm_cpu.sh --new .venv-vllm)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    sizes = L.QUICK if a.quick else L.FULL
    demo = L.demo_dir(a.out, a.seed, sizes, engine="vllm")  # both engines run the model vLLM can
    goal = target(a.seed, REPO / "benchmarks" / "results" / "hf_learning.json")
    hp = L.CHOSEN["hpcrl-grpo"]
    runs: dict[str, Any] = {}
    load_start = loadavg()
    for engine in ENGINES:
        ns = argparse.Namespace(batch_size=16, group_size=4, max_new_tokens=4, steps=sizes["steps"],
                                eval_every=sizes["eval_every"], seed=a.seed, out=a.out, tag=f"-{engine}",
                                timeout_s=a.timeout_s, extra=["--hf.engine", engine])
        run = L.run_hpcrl("hpcrl-grpo", demo, ns, hp)
        runs[engine] = {**run, "summary": summary(run, goal)}
        s = runs[engine]["summary"]
        print(f"engines_learning: {engine}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, "
              f"{s['tokens_per_s']:.0f} tokens/s, train {s['train_s']:.1f} s, process {s['process_wall_s']:.1f} s, "
              f"launch to target {s['launch_to_target_s']}", flush=True)
    doc = {"benchmark": "engines_learning", "machine": machine_info("cpu", 1), "quick": a.quick, "seed": a.seed,
           "loadavg_start": load_start, "loadavg_end": loadavg(),
           "target": {"reward": goal, "what": "TRL's final reward on this seed (hf_learning.json)"},
           "summary": {e: r["summary"] for e, r in runs.items()}, "runs": runs}
    print(f"engines_learning: wrote {write_json(a.json, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
