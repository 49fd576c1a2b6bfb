#!/usr/bin/env python
"""Tool use learned by RL: the ``sum A B`` task of :mod:`hpcrl.ppo.demo_tools`, trained with the ``add`` tool
(``--hf.tools``, two turns: call, then answer) and without it (one turn: answer directly), same model,
records, seed and number of updates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf/tool_learning.py [--quick] [--json PATH]

The task (built once under ``--out``): a 2-layer, hidden-64 Llama with a word-level tokenizer, pre-trained on
the *format* only (a tool call on half the lines, then an answer that is A or B more often than the
result); 1024 training records ``sum A B`` and 64 held-out records whose unordered pair never occurs in
training; the reward is 1.0 when the answer's last word is A + B. Both runs are real ``python -m hpcrl.ppo
--workload hf`` processes (1 maker : 1 trainer, one torch thread each; GRPO, 16 prompts x 8 episodes per
update), their arguments from :func:`hpcrl.ppo.demo_tools.command`; each evaluates the held-out records as
greedy episodes every ``--eval-every`` updates (``eval_pass_rate``). Update 0 (the pre-trained model) is
scored here by :func:`hpcrl.ppo.demo_tools.play`, which plays the episodes as the runs' evaluation does.

The JSON (``benchmarks/results/hf_tool_learning.json``): per run the command, per-update ``score`` (mean
sampled episode return), ``tool_call_rate``, ``observation_token_frac``, ``turns``, ``truncated_frac``,
the evals, the process wall time and throughput (episodes/s and policy tokens/s over the training time,
policy + observation tokens/s, the median ``maker_tokens_per_s`` / ``trainer_tokens_per_s``); the summary
(held-out pass rate at update 0 and at the end with and without the tool, tool-call rate and score at
update 1, over the first and the last 10 updates, observation token share); machine facts and the 1-min load average at the start and end of the benchmark and of each run (a
run's own two ranks add about 2 to it on this 2-core machine). The PNG (same name): tool-call rate,
sampled reward and held-out pass rate vs updates, with the tool and without.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common.schema import git_commit  # noqa: E402
from benchmarks.common.timing import loadavg, machine_info, write_json  # noqa: E402
from hpcrl.ppo import demo_tools as D  # noqa: E402

FULL = {"steps": D.STEPS, "eval_every": 10, "pretrain_steps": D.PRETRAIN_STEPS}
QUICK = {"steps": 6, "eval_every": 3, "pretrain_steps": 60}
RUNS = ("with_tool", "without_tool")
COLOURS = {"with_tool": "tab:green", "without_tool": "tab:red"}
LAST = 10
"""Updates averaged for a run's "end" figures (tool-call rate, score, observation share)."""


def fail(msg: str) -> None:
    print(f"tool_learning: error: {msg}", file=sys.stderr)
    sys.exit(2)


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**clean, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), clean.get("PYTHONPATH", "")) if p)}


def build_task(out: Path, seed: int, pretrain_steps: int) -> tuple[D.Built, dict[str, Any]]:
    """The task under ``out`` (rebuilt every time: a few seconds to ~20 s) and the update-0 evals."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    built = D.build(out / f"task-seed{seed}", seed, pretrain_steps)
    build_s = time.perf_counter() - t0
    held = D.read_jsonl(built.eval)
    start = {}
    for name, tools in (("with_tool", True), ("without_tool", False)):
        played = D.play(built.model, held, tools)
        scores = [s for _, s in played]
        start[name] = {"update": 0, "eval_pass_rate": sum(s >= 1.0 for s in scores) / len(scores),
                       "eval_reward": sum(scores) / len(scores), "example": played[0][0]}
    return built, {"build_s": round(build_s, 1), "update0": start}


def read_rows(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(update rows, eval rows)`` of a run's metrics.jsonl; the final row (a repeat of the last update's) dropped."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates: list[dict[str, Any]] = []
    for r in rows:
        if "score" in r and not (updates and r["updates"] == updates[-1]["updates"]):
            updates.append(r)
    return updates, [r for r in rows if "eval_pass_rate" in r]


def curve(updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("score", "tool_call_rate", "observation_token_frac", "turns", "truncated_frac", "tool_error_frac",
            "response_len", "sequences", "maker_tokens_per_s", "trainer_tokens_per_s")
    return [{"update": r["updates"], "time_s": r["time"], "policy_tokens": r["env_steps"],
             **{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keys}} for r in updates]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def throughput(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Episodes/s and policy tokens/s over the training time (first row's start to the last row), and the
    rows' median generation / training rates; with observations, all tokens after the prompts too."""
    train_s = points[-1]["time_s"]
    episodes = sum(p["sequences"] or 0 for p in points)
    obs = mean([p["observation_token_frac"] or 0.0 for p in points]) or 0.0
    tokens = points[-1]["policy_tokens"]
    return {"train_s": train_s, "episodes": episodes, "episodes_per_s": episodes / train_s,
            "policy_tokens_per_s": tokens / train_s, "episode_tokens_per_s": tokens / (1 - obs) / train_s,
            "maker_tokens_per_s_median": statistics.median(p["maker_tokens_per_s"] for p in points),
            "trainer_tokens_per_s_median": statistics.median(p["trainer_tokens_per_s"] for p in points)}


def run(name: str, built: D.Built, a: argparse.Namespace, update0: dict[str, Any]) -> dict[str, Any]:
    run_dir = a.out / f"run-{name}-seed{a.seed}"
    cmd = D.command(built, name == "with_tool", a.steps, run_dir, a.seed, a.eval_every) + ["--overwrite"]
    load = loadavg()
    t0 = time.perf_counter()
    with open(a.out / f"{name}-seed{a.seed}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=a.out, timeout=a.timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        fail(f"the {name} run exited {proc.returncode}; see {log.name}")
    updates, evals = read_rows(run_dir)
    points = curve(updates)
    ev = [update0] + [{"update": r["updates"], "time_s": r["time"], "eval_pass_rate": r["eval_pass_rate"],
                       "eval_reward": r["eval_reward"]} for r in evals]
    return {"name": name, "command": cmd, "process_wall_s": round(wall, 1), "loadavg_start": load,
            "loadavg_end": loadavg(), "curve": points, "eval": ev,
            **throughput(points)}


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per run: held-out pass rate at update 0 / at the end, tool-call rate and score at update 1 and over the
    first and last :data:`LAST` updates, the observation token share, throughput."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        c = r["curve"]
        first, last = c[:LAST], c[-LAST:]
        avg = lambda pts, k: mean([p[k] or 0.0 for p in pts])  # noqa: E731 - absent (no tool): 0
        out[name] = {"eval_pass_start": r["eval"][0]["eval_pass_rate"],
                     "eval_pass_end": r["eval"][-1]["eval_pass_rate"],
                     "eval_pass_best": max(e["eval_pass_rate"] for e in r["eval"]),
                     "tool_call_rate_update1": c[0]["tool_call_rate"] or 0.0,
                     "tool_call_rate_start": avg(first, "tool_call_rate"),
                     "tool_call_rate_end": avg(last, "tool_call_rate"),
                     "score_update1": c[0]["score"], "score_start": avg(first, "score"), "score_end": avg(last, "score"),
                     "observation_token_frac_end": avg(last, "observation_token_frac"),
                     **{k: r[k] for k in ("episodes_per_s", "policy_tokens_per_s", "episode_tokens_per_s",
                                          "maker_tokens_per_s_median", "trainer_tokens_per_s_median", "train_s",
                                          "process_wall_s")}}
    for figures in out.values():
        figures.update({k: round(v, 4) for k, v in figures.items() if isinstance(v, float)})
    w, wo = out.get("with_tool"), out.get("without_tool")
    if w and wo:
        out["held_out_pass_end"] = {"with_tool": w["eval_pass_end"], "without_tool": wo["eval_pass_end"]}
    return out


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in runs.items():
        c, colour = r["curve"], COLOURS[name]
        label = name.replace("_", " ")
        x = [p["update"] for p in c]
        ax[0].plot(x, [p["tool_call_rate"] or 0.0 for p in c], color=colour,
                   label=label if name == "with_tool" else f"{label} (no tool to call)")
        ax[1].plot(x, [p["score"] for p in c], color=colour, alpha=0.3)
        ax[1].plot(x, moving([p["score"] for p in c], LAST), color=colour, label=f"{label} ({LAST}-update mean)")
        ax[2].plot([e["update"] for e in r["eval"]], [e["eval_pass_rate"] for e in r["eval"]], "o-", color=colour,
                   label=label, markersize=3)
    ax[0].set(xlabel="updates", ylabel="share of episodes calling the tool", title="tool-call rate (sampled)")
    ax[1].set(xlabel="updates", ylabel="mean episode return", title="sampled reward")
    ax[2].set(xlabel="updates", ylabel="held-out greedy pass rate", title="held-out pass rate (64 unseen sums)")
    for a in ax:
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
        a.legend(loc="best", fontsize=8)
    fig.suptitle("sum A B with the add tool (2 turns) vs without (1 turn): GRPO, 1 maker : 1 trainer, 2-layer "
                 "hidden-64 Llama, CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def moving(xs: list[float], k: int) -> list[float]:
    """Trailing mean over the last ``k`` values (fewer at the start)."""
    return [sum(xs[max(0, i + 1 - k):i + 1]) / (i + 1 - max(0, i + 1 - k)) for i in range(len(xs))]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a smoke test: {QUICK}")
    ap.add_argument("--seed", type=int, default=0, help="task, model init and both runs (default: 0)")
    ap.add_argument("--steps", type=int, default=None, help=f"updates per run (default: {FULL['steps']})")
    ap.add_argument("--eval-every", type=int, default=None, help=f"default: {FULL['eval_every']}")
    ap.add_argument("--pretrain-steps", type=int, default=None, help=f"default: {FULL['pretrain_steps']}")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "hf-tool-learning", help="task, runs and logs")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "hf_tool_learning.json",
                    help="the result (and its .png)")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    a = ap.parse_args(argv)
    sizes = QUICK if a.quick else FULL
    a.steps, a.eval_every, a.pretrain_steps = (v if v is not None else sizes[k] for k, v in (
        ("steps", a.steps), ("eval_every", a.eval_every), ("pretrain_steps", a.pretrain_steps)))
    for name, lo in (("steps", 1), ("eval_every", 1), ("pretrain_steps", 0)):
        if getattr(a, name) < lo:
            fail(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= {lo}")
    a.out = a.out.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info = machine_info("cpu", 1)
    info.update(git=git_commit(), torch_threads_per_process=1, loadavg_start=loadavg())
    print(f"tool_learning: {info['cpu_model']}, {info['cpu_count']} cpus, load {info['loadavg_start']}"
          + (" [quick]" if a.quick else ""), flush=True)
    built, task = build_task(a.out, a.seed, a.pretrain_steps)
    print(f"tool_learning: task built in {task['build_s']} s; update-0 held-out pass rate "
          f"{ {k: v['eval_pass_rate'] for k, v in task['update0'].items()} }", flush=True)
    runs = {}
    for name in RUNS:
        runs[name] = run(name, built, a, task["update0"][name])
        r = runs[name]
        print(f"tool_learning: {name}: held-out pass {r['eval'][0]['eval_pass_rate']:.2f} -> "
              f"{r['eval'][-1]['eval_pass_rate']:.2f}, "
              f"{r['episodes_per_s']:.0f} episodes/s, {r['policy_tokens_per_s']:.0f} policy tokens/s, "
              f"process {r['process_wall_s']} s", flush=True)
    info["loadavg_end"] = loadavg()
    summary = summarise(runs)
    payload = {"benchmark": "hf_tool_learning", "quick": a.quick, "machine": info,
               "params": {"seed": a.seed, "steps": a.steps, "eval_every": a.eval_every,
                          "pretrain_steps": a.pretrain_steps, "numbers": D.NUMBERS, "tool_share": D.TOOL_SHARE,
                          "answer_mix": dict(D.ANSWER_MIX), "train_records": D.TRAIN_RECORDS,
                          "eval_records": D.EVAL_RECORDS, "setup": "2 processes per run (1 maker : 1 trainer), "
                          "1 torch thread each, runs one after the other; CPU"},
               "task": task, "summary": summary, "runs": runs,
               "seconds": {"total": round(time.perf_counter() - t0, 1)}}
    write_json(a.json, payload)
    plot(runs, a.json.with_suffix(".png"))
    w, wo = summary["with_tool"], summary["without_tool"]
    print(f"tool_learning: held-out pass rate with the tool {w['eval_pass_start']:.2f} -> {w['eval_pass_end']:.2f}, "
          f"without {wo['eval_pass_start']:.2f} -> {wo['eval_pass_end']:.2f}; tool-call rate "
          f"{w['tool_call_rate_update1']:.2f} (update 1) -> {w['tool_call_rate_end']:.2f}; observation share "
          f"{w['observation_token_frac_end']:.3f}; {payload['seconds']['total']} s; wrote {a.json} and "
          f"{a.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
