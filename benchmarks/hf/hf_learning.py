#!/usr/bin/env python
"""Learning curves on the hf demo's verifiable task: hpcrl's detached PPO and GRPO vs TRL's GRPOTrainer.

    # one (system, seed) per invocation (each a process of its own; runs/hf-learning by default)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf/hf_learning.py --system hpcrl-grpo --seed 0
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf/hf_learning.py --system hpcrl-ppo --seed 0
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf/hf_learning.py --system trl-grpo --seed 0   # needs .venv-trl
    .venv/bin/python benchmarks/hf/hf_learning.py --merge   # -> benchmarks/results/hf_learning.{json,png}

The task is ``python -m hpcrl.ppo.demo``'s (built here once per seed, under ``--out``): a 2-layer,
hidden-64 Llama pre-trained on the answer format only, records ``{"prompt": "list: cat dog", "answer":
[...]}``, the checker :func:`hpcrl.ppo.demo_task.reward` (share of the first three answer words in the
record's answer) and 48 held-out records scored greedily (``eval_pass_rate``: share scoring 1.0).

The budget is the same for every system: ``--batch-size`` prompts x ``--group-size`` samples per
update (PPO: batch x group prompts, one sample each: the same number of generated samples),
``--max-new-tokens`` 4, ``--steps`` updates, the same prompts file, one torch thread per process.
hpcrl runs 1 maker : 1 trainer (``python -m hpcrl.ppo --workload hf``, 2 processes, lag 1); TRL runs
one process (``benchmarks/peers/run_trl.py`` in ``.venv-trl``, ``bash tools/trl_venv.sh``).

Each run's JSON: ``curve`` (update, time_s since training started, reward = mean sampled reward of the
update's batch, tokens = generated tokens), ``eval`` (update, time_s, eval_reward, eval_pass_rate),
``process_wall_s`` (launch to exit, imports and model loading included), ``tokens_per_s``. ``--merge``
writes the summary (per system: reward first / last, eval pass rate first / last, tokens/s, and the
wall time at which the 10-update moving average of the reward first reaches TRL's final reward) and
a PNG (reward and eval pass rate vs updates, reward vs wall time).

Hyper-parameters are flags (``--lr --kl-coef --clip --epochs --minibatches --temperature``); unset,
they are this benchmark's chosen defaults for each system (``CHOSEN``; see docs/hf_learning.md).
"""

from __future__ import annotations

import argparse
import glob
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
SYSTEMS = ("hpcrl-ppo", "hpcrl-grpo", "trl-grpo")
CHOSEN: dict[str, dict[str, Any]] = {
    # measured on this task (docs/hf_learning.md): what each knob bought
    "hpcrl-ppo": {"lr": 1e-3, "kl_coef": 0.01, "clip": 0.2, "epochs": 2, "minibatches": 2, "temperature": 1.0},
    "hpcrl-grpo": {"lr": 1e-3, "kl_coef": 0.0, "clip": 0.2, "epochs": 2, "minibatches": 2, "temperature": 1.0},
    "trl-grpo": {"lr": 1e-3, "kl_coef": 0.0, "clip": 0.2, "epochs": 1, "minibatches": 1, "temperature": 1.0},
}
QUICK = {"steps": 12, "eval_every": 6, "pretrain_steps": 40, "prompts": 64}
FULL = {"steps": 200, "eval_every": 25, "pretrain_steps": 300, "prompts": 256}


def fail(msg: str) -> None:
    print(f"hf_learning: error: {msg}", file=sys.stderr)
    sys.exit(2)


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**clean, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def demo_dir(out: Path, seed: int, sizes: dict[str, int], engine: str = "hf") -> Path:
    """The demo's model (built for the makers' ``engine``: ``python -m hpcrl.ppo.demo --engine``), prompts and
    eval set for ``seed`` (built once, reused by every system)."""
    d = out / f"demo-{'' if engine == 'hf' else engine + '-'}seed{seed}-p{sizes['pretrain_steps']}-n{sizes['prompts']}"
    if not (d / ".complete").exists():
        sys.path.insert(0, str(REPO))
        import torch
        import transformers

        from hpcrl.ppo.demo import build

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(1)
        build(d, seed=seed, pretrain_steps=sizes["pretrain_steps"], prompts=sizes["prompts"], engine=engine)
        (d / "baseline.json").write_text(json.dumps(baseline_eval(d)))
        (d / ".complete").write_text("")
    return d


def baseline_eval(demo: Path) -> dict[str, float]:
    """The untrained model's greedy score on eval.jsonl (update 0 of hpcrl's eval curve; TRL's run
    scores update 0 itself, the same way)."""
    from hpcrl.ppo.demo_task import greedy_answers, reward

    records = [json.loads(line) for line in (demo / "eval.jsonl").read_text().splitlines() if line.strip()]
    scores = reward(records, greedy_answers(demo / "model", [r["prompt"] for r in records]))
    return {"eval_reward": sum(scores) / len(scores), "eval_pass_rate": sum(s >= 1.0 for s in scores) / len(scores)}


def hpcrl_cmd(system: str, demo: Path, run_dir: Path, a: argparse.Namespace, hp: dict[str, Any]) -> list[str]:
    grpo = system == "hpcrl-grpo"
    batch = a.batch_size if grpo else a.batch_size * a.group_size  # same generated samples per update
    cmd = [sys.executable, "-m", "hpcrl.ppo", "--workload", "hf", "--hf.model", str(demo / "model"),
           "--hf.reward-fn", "hpcrl.ppo.demo:reward", "--hf.prompts", str(demo / "prompts.jsonl"),
           "--hf.eval-prompts", str(demo / "eval.jsonl"), "--hf.eval-every", str(a.eval_every),
           "--hf.max-prompt-tokens", "3", "--hf.max-new-tokens", str(a.max_new_tokens),
           "--hf.batch-size", str(batch), "--hf.temperature", str(hp["temperature"]),
           "--ppo.lr", str(hp["lr"]), "--ppo.kl-coef", str(hp["kl_coef"]), "--ppo.clip-coef", str(hp["clip"]),
           "--ppo.epochs", str(hp["epochs"]), "--ppo.minibatches", str(hp["minibatches"]),
           "--makers", "1", "--trainers", "1", "--total-steps", str(a.steps), "--seed", str(a.seed),
           "--run-dir", str(run_dir), "--overwrite", "--checkpoint-every", "0"]
    if grpo:
        cmd += ["--hf.algo", "grpo", "--hf.group-size", str(a.group_size)]
    return cmd + a.extra


def run_logged(system: str, cmd: list[str], a: argparse.Namespace) -> float:
    """Run one system's process with its output in ``OUT/SYSTEM-seedS.log``; its wall seconds (exit on failure)."""
    t0 = time.perf_counter()
    with open(a.out / f"{system}-seed{a.seed}{a.tag}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO, timeout=a.timeout_s)
    if proc.returncode != 0:
        fail(f"{system} exited {proc.returncode}; see {log.name}")
    return time.perf_counter() - t0


def run_hpcrl(system: str, demo: Path, a: argparse.Namespace, hp: dict[str, Any]) -> dict[str, Any]:
    run_dir = a.out / f"run-{system}-seed{a.seed}{a.tag}"
    cmd = hpcrl_cmd(system, demo, run_dir, a, hp)
    wall = run_logged(system, cmd, a)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates = [r for r in rows if "score" in r]
    curve, prev = [], 0
    for r in updates:
        if curve and r["updates"] == curve[-1]["update"]:
            continue  # the run's final row repeats the last update's
        curve.append({"update": r["updates"], "time_s": r["time"], "reward": r["reward"],
                      "tokens": r["env_steps"] - prev, "entropy": r.get("entropy")})
        prev = r["env_steps"]
    base = json.loads((demo / "baseline.json").read_text())
    evals = [{"update": 0, "time_s": 0.0, **base}] + [{"update": r["updates"], "time_s": r["time"], "eval_reward": r["eval_reward"],
              "eval_pass_rate": r["eval_pass_rate"]} for r in rows if "eval_reward" in r]
    train_s = curve[-1]["time_s"]
    return {"system": system, "seed": a.seed, "command": cmd, "curve": curve, "eval": evals, "process_wall_s": wall,
            "train_s": train_s, "tokens": prev, "tokens_per_s": prev / train_s}


def run_trl(demo: Path, a: argparse.Namespace, hp: dict[str, Any]) -> dict[str, Any]:
    py = REPO / ".venv-trl" / "bin" / "python"
    if not py.exists():
        fail(f"{py} missing; make it with: bash tools/trl_venv.sh")
    part = a.out / f"trl-grpo-seed{a.seed}{a.tag}.part.json"
    cmd = [str(py), str(REPO / "benchmarks" / "peers" / "run_trl.py"), "--demo", str(demo), "--json", str(part),
           "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--lr", str(hp["lr"]), "--beta", str(hp["kl_coef"]),
           "--epsilon", str(hp["clip"]), "--num-iterations", str(hp["epochs"]), "--temperature",
           str(hp["temperature"]), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
           "--threads", str(a.trl_threads), *a.extra]
    wall = run_logged("trl-grpo", cmd, a)
    d = json.loads(part.read_text())
    part.unlink()
    d.update(command=cmd, process_wall_s=wall)
    return d


# ---------------------------------------------------------------------------- summary (pure)


def moving(xs: list[float], k: int) -> list[float]:
    """Trailing mean over the last ``k`` values (fewer at the start)."""
    return [sum(xs[max(0, i + 1 - k):i + 1]) / (i + 1 - max(0, i + 1 - k)) for i in range(len(xs))]


def final_reward(run: dict[str, Any], k: int = 10) -> float:
    rewards = [r["reward"] for r in run["curve"]]
    return sum(rewards[-k:]) / len(rewards[-k:])


def time_to(run: dict[str, Any], target: float, k: int = 10) -> float | None:
    """Training wall time at which the ``k``-update moving average of the reward first reaches ``target``."""
    avg = moving([r["reward"] for r in run["curve"]], k)
    return next((r["time_s"] for r, m in zip(run["curve"], avg) if m >= target), None)


def summarise(runs: list[dict[str, Any]], k: int = 10) -> dict[str, Any]:
    """Per system (medians over seeds), and the time each run takes to reach TRL's final reward on
    the same seed (the same model and prompts: seeds differ in difficulty)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["system"], []).append(r)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    finals: dict[int, list[float]] = {}
    for r in by.get("trl-grpo", []):
        finals.setdefault(r["seed"], []).append(final_reward(r, k))
    targets = {seed: statistics.median(v) for seed, v in finals.items()}
    out: dict[str, Any] = {"target": {"what": f"TRL's final reward (mean of its last {k} updates) on the same seed",
                                      "reward_by_seed": {str(s): v for s, v in sorted(targets.items())}}}
    for system, rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        times = [time_to(r, targets[r["seed"]], k) if r["seed"] in targets else None for r in rs]
        out[system] = {
            "seeds": [r["seed"] for r in rs],
            "reward_first": med([sum(x["reward"] for x in r["curve"][:5]) / len(r["curve"][:5]) for r in rs]),
            "reward_last": med([final_reward(r, k) for r in rs]),
            "reward_last_by_seed": [final_reward(r, k) for r in rs],
            "eval_pass_first": med([r["eval"][0]["eval_pass_rate"] for r in rs if r["eval"]]),
            "eval_pass_last": med([r["eval"][-1]["eval_pass_rate"] for r in rs if r["eval"]]),
            "eval_pass_last_by_seed": [r["eval"][-1]["eval_pass_rate"] if r["eval"] else None for r in rs],
            "eval_reward_last": med([r["eval"][-1]["eval_reward"] for r in rs if r["eval"]]),
            "tokens_per_s": med([r["tokens_per_s"] for r in rs]),
            "train_s": med([r["train_s"] for r in rs]),
            "process_wall_s": med([r["process_wall_s"] for r in rs]),
            "time_to_target_s": times, "time_to_target_s_median": med([t for t in times if t is not None]),
            "reached_target": sum(t is not None for t in times),
        }
    # interleaved pairs (same seed, same --tag: run one after the other): TRL's time over hpcrl GRPO's
    grpo = {(r["seed"], r.get("tag", "")): r for r in by.get("hpcrl-grpo", [])}
    pairs = []
    for r in by.get("trl-grpo", []):
        h = grpo.get((r["seed"], r.get("tag", "")))
        if h is None:
            continue
        t_trl, t_h = time_to(r, targets[r["seed"]], k), time_to(h, targets[r["seed"]], k)
        pairs.append({"seed": r["seed"], "tag": r.get("tag", ""), "trl_s": t_trl, "hpcrl_grpo_s": t_h,
                      "trl_over_hpcrl": t_trl / t_h if t_trl and t_h else None,
                      "tokens_per_s_hpcrl_over_trl": h["tokens_per_s"] / r["tokens_per_s"],
                      "loadavg_1min": [h.get("loadavg_start", [None])[0], r.get("loadavg_start", [None])[0]]})
    ratios = [p["trl_over_hpcrl"] for p in pairs if p["trl_over_hpcrl"] is not None]
    out["pairs"] = {"what": "time to TRL's final reward, TRL / hpcrl GRPO, per interleaved pair", "pairs": pairs,
                    "median_trl_over_hpcrl": med(ratios),
                    "median_tokens_per_s_hpcrl_over_trl": med([p["tokens_per_s_hpcrl_over_trl"] for p in pairs])}
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"hpcrl-ppo": "tab:blue", "hpcrl-grpo": "tab:green", "trl-grpo": "tab:red"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes.ravel()
    seen: set[str] = set()
    for r in sorted(runs, key=lambda r: (r["system"], r["seed"])):
        c = colours.get(r["system"], "k")
        label = None if r["system"] in seen else r["system"]
        seen.add(r["system"])
        avg = moving([x["reward"] for x in r["curve"]], 10)
        ax[0].plot([x["update"] for x in r["curve"]], avg, color=c, alpha=0.8, label=label)
        ax[1].plot([e["update"] for e in r["eval"]], [e["eval_pass_rate"] for e in r["eval"]], "o-", color=c,
                   alpha=0.8, label=label)
        ax[2].plot([x["time_s"] for x in r["curve"]], avg, color=c, alpha=0.8, label=label)
        ax[3].plot([e["time_s"] for e in r["eval"]], [e["eval_pass_rate"] for e in r["eval"]], "o-", color=c,
                   alpha=0.8, label=label)
    wall = "training wall time, s (2-core VM, shared)"
    ax[0].set(xlabel="updates", ylabel="sampled reward (10-update mean)", title="reward vs updates")
    ax[1].set(xlabel="updates", ylabel="held-out greedy pass rate", title="eval pass rate vs updates", ylim=(0, 1.02))
    ax[2].set(xlabel=wall, ylabel="sampled reward (10-update mean)", title="reward vs wall time")
    ax[3].set(xlabel=wall, ylabel="held-out greedy pass rate", title="eval pass rate vs wall time", ylim=(0, 1.02))
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(a: argparse.Namespace) -> int:
    paths = sorted(p for pat in (a.merge or [str(a.out / "*-seed*.json")]) for p in glob.glob(pat))
    runs = [json.loads(Path(p).read_text()) for p in paths]
    runs = [r for r in runs if r.get("system") in SYSTEMS and r.get("curve")]
    for r in runs:  # one point per update (older hpcrl JSONs kept the run's repeated final row)
        r["curve"] = [c for i, c in enumerate(r["curve"]) if i == 0 or c["update"] != r["curve"][i - 1]["update"]]
    if not runs:
        fail(f"no run JSONs matched {a.merge or str(a.out / '*-seed*.json')}; run --system ... first")
    summary = summarise(runs)
    for r in runs:  # 4 significant decimals keep the merged file small (hundreds of points per run)
        for pts in (r["curve"], r["eval"]):
            for p in pts:
                p.update({k: round(v, 4) for k, v in p.items() if isinstance(v, float)})
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "hf_learning", "quick": any(r.get("quick") for r in runs), "summary": summary,
               "runs": runs, "sources": paths}
    head = json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1)
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in runs)  # one line per run
    out.write_text(head[:-2] + ',\n "runs": [\n' + body + "\n ]\n}\n")
    plot(runs, out.with_suffix(".png"))
    for system in SYSTEMS:
        s = summary.get(system)
        if s:
            print(f"{system:11s} seeds {s['seeds']}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, eval pass "
                  f"{s['eval_pass_first']} -> {s['eval_pass_last']}, {s['tokens_per_s']:.0f} tokens/s, train "
                  f"{s['train_s']:.1f} s, process {s['process_wall_s']:.1f} s, time to TRL's final reward "
                  f"{s['time_to_target_s']}")
    pr = summary["pairs"]
    print(f"pairs (TRL / hpcrl GRPO time to TRL's final reward): {[p['trl_over_hpcrl'] for p in pr['pairs']]}, "
          f"median {pr['median_trl_over_hpcrl']}; tokens/s hpcrl / TRL median {pr['median_tokens_per_s_hpcrl_over_trl']}")
    print(f"hf_learning: wrote {out} and {out.with_suffix('.png')}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=SYSTEMS)
    ap.add_argument("--merge", nargs="*", default=None, metavar="JSON",
                   help="merge run JSONs (default: OUT/*-seed*.json) into --json and its PNG")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a test: {QUICK}")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "hf-learning", help="demo dirs, runs, run JSONs")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "hf_learning.json"), help="--merge's output")
    ap.add_argument("--tag", default="", help="suffix of this run's files (a sweep's candidate name)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per update (GRPO; PPO gets x group size)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    for name in ("lr", "kl_coef", "clip", "temperature"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None, help="default: CHOSEN[system]")
    for name in ("epochs", "minibatches"):
        ap.add_argument("--" + name, type=int, default=None, help="default: CHOSEN[system]")
    ap.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL process")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more flags for the system's command")
    a = ap.parse_args(argv)
    if (a.system is None) == (a.merge is None):
        fail("pass --system hpcrl-ppo|hpcrl-grpo|trl-grpo (one run) or --merge (the summary), not both or neither")
    sizes = QUICK if a.quick else FULL
    a.sizes = sizes
    a.steps = a.steps or sizes["steps"]
    a.eval_every = a.eval_every or sizes["eval_every"]
    for name, lo in (("steps", 1), ("eval_every", 1), ("batch_size", 1), ("group_size", 2), ("max_new_tokens", 1)):
        if getattr(a, name) < lo:
            fail(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= {lo}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.merge is not None:
        return merge(a)
    hp = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in CHOSEN[a.system].items()}
    load_start = os.getloadavg()
    demo = demo_dir(a.out, a.seed, a.sizes)
    run = run_trl(demo, a, hp) if a.system == "trl-grpo" else run_hpcrl(a.system, demo, a, hp)
    run.update(quick=a.quick, tag=a.tag, hyper=hp, loadavg_start=load_start, loadavg_end=os.getloadavg(),
               budget={"steps": a.steps, "samples_per_update": a.batch_size * a.group_size,
                       # PPO: batch x group prompts, one sample each (the same samples per update)
                       "prompts_per_update": a.batch_size * (a.group_size if a.system == "hpcrl-ppo" else 1),
                       "samples_per_prompt": 1 if a.system == "hpcrl-ppo" else a.group_size, "max_new_tokens": a.max_new_tokens,
                       "eval_every": a.eval_every, **a.sizes}, cpu_count=os.cpu_count())
    path = a.out / f"{a.system}-seed{a.seed}{a.tag}.json"
    path.write_text(json.dumps(run, indent=1))
    ev = run["eval"]
    print(f"hf_learning: {a.system} seed {a.seed}: reward {run['curve'][0]['reward']:.3f} -> {final_reward(run):.3f} "
          f"(last 10), eval pass {ev[0]['eval_pass_rate']:.2f} -> {ev[-1]['eval_pass_rate']:.2f}, "
          f"{run['tokens_per_s']:.0f} tokens/s, train {run['train_s']:.1f} s, process {run['process_wall_s']:.1f} s; "
          f"{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
