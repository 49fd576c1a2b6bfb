#!/usr/bin/env python
"""Detached PPO on the real Hugging Face workload (``--workload hf``): lag 1 vs lag 0, and the weight
publish time vs model size, timed from detached PPO's events hook.

    OMP_NUM_THREADS=1 python benchmarks/hf/hf_detached.py [--quick] [--json PATH]

One invocation, one spawn of 2 ranks (1 maker : 1 trainer, gloo on loopback), ONE torch thread per
rank: on a 2-core machine that is the honest setup (each role gets one core; more threads would
oversubscribe them). The models are random-init 2-layer Llamas built locally (the tokenizer of
tests/hf_fixtures.py, its 26-word vocabulary; hidden H, intermediate 2H, 4 heads, 2 KV heads); prompts
are hf_fixtures' 3-word jsonl, the reward is the verifiable ``hf_fixtures:target_fraction``.
Generation and PPO settings are the same at every size (16 prompts x 32 new tokens per batch, one
PPO epoch of one minibatch) and chosen so that a rollout (generate with the KV cache + behaviour and
reference log-probs + reward) and an update (critic values + actor and critic forward / backward +
Adam) take comparable time (the lag-0 collect_ms / update_ms in the JSON): that is where overlap can
pay (ideal 2x). More epochs or minibatches would only make the update longer than the rollout.

1. Ratio: tokens/s (``env_steps`` of the hf workload = response tokens) of ``--lag 1`` over ``--lag 0``
   at the ratio size, repeats interleaved (lag 1, lag 0, next size, ..., next repeat); the median of
   per-pair ratios. Reported with the measured collect ms (RolloutDone: collect_start -> time) and
   trainer-busy ms per step (row interval x (1 - trainer_idle_frac): update, flattening the weights
   for the publisher, logging). "ideal" = (c + u) / max(c, u) from the lag-0 runs, where the two
   phases alternate (each rank runs while its peer waits); at lag 1 they run at the same time on the 2
   cores (with the publisher and weight-receiver threads), so the lag-1 rows show their contended c, u.
2. Publish: trainer 0's ``WeightsPublished.seconds`` (median per version) and ``nbytes`` at every size,
   with the tokens/s of both lags there.

The runs, the steady window (from the row after the first 15 % of steps), the trainer / maker idle
fractions and lags are benchmarks/ppo/ppo_throughput.py's (``rank_worker``, ``analyse_detached``,
``summarise``, imported); other users' load on the machine is recorded as ``loadavg``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PPO = os.path.join(os.path.dirname(HERE), "ppo")
TESTS = os.path.join(REPO, "tests")
# spawned ranks inherit sys.path: they import ppo_throughput (rank_worker) and hf_fixtures (the reward fn)
for p in (HERE, PPO, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)
if TESTS not in sys.path:
    sys.path.append(TESTS)
import ppo_throughput as pt  # noqa: E402
from benchmarks.common.timing import loadavg, machine_info, print_table, write_json  # noqa: E402

MiB = 2**20
REWARD = "hf_fixtures:target_fraction"


def build_llama(out: Path, hidden: int, seed: int = 0) -> dict[str, Any]:
    """A random 2-layer Llama of width ``hidden`` + hf_fixtures' tokenizer in ``out`` (save_pretrained)."""
    import hf_fixtures as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = F.build_tokenizer(out)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    numel = sum(p.numel() for p in model.parameters())
    return {"dir": str(out), "hidden": hidden, "params": numel, "param_bytes": 4 * numel}


def hf_cfg(model_dir: str, prompts: str, p: dict[str, Any], lag: int, steps: int, run_dir: str):
    from hpcrl.ppo.config import DetachedConfig
    from hpcrl.ppo.workloads.hf_options import HFGroupOptions
    from hpcrl.ppo.workloads.options import PPOOptions

    hf = HFGroupOptions(model=model_dir, reward_fn=REWARD, prompts=prompts, max_prompt_tokens=p["max_prompt_tokens"],
                        max_new_tokens=p["max_new_tokens"], batch_size=p["batch_size"])
    return DetachedConfig(workload="hf", hf=hf, ppo=PPOOptions(epochs=p["epochs"], minibatches=p["minibatches"]),
                          makers=1, trainers=1, lag=lag, total_steps=steps, run_dir=run_dir, timeout_s=120.0,
                          heartbeat_timeout_s=20.0, checkpoint_every=0, seed=0)


def analyse(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """ppo_throughput's analysis plus collect / trainer-busy ms per step and the publish sizes."""
    from hpcrl.ppo.events import RolloutDone, RowLogged, WeightsPublished

    s = pt.analyse_detached(per_rank)
    trainer, maker = per_rank[0]["events"], per_rank[1]["events"]
    rows = [(e.time, e.row) for e in trainer if isinstance(e, RowLogged) and e.trainer == 0]
    k0, (lo, hi) = pt._window(rows)
    busy = [(rows[i][0] - rows[i - 1][0]) * (1 - rows[i][1]["trainer_idle_frac"]) for i in range(k0 + 1, len(rows))]
    collect = [e.time - e.collect_start for e in maker if isinstance(e, RolloutDone) and lo < e.time <= hi]
    pubs = [e for e in trainer if isinstance(e, WeightsPublished)]
    s.update(tokens_per_s=s["env_steps_per_s"], collect_ms=1e3 * statistics.median(collect),
             update_ms=1e3 * statistics.median(busy), publish_nbytes=sorted({e.nbytes for e in pubs}),
             publish_transports=sorted({e.transport for e in pubs}),
             tokens_per_step=(rows[-1][1]["env_steps"] - rows[k0][1]["env_steps"]) / (len(rows) - k0 - 1))
    return s


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = pt.summarise(runs)
    for key in ("tokens_per_s", "collect_ms", "update_ms", "tokens_per_step"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def git_state() -> dict[str, Any]:
    """The commit measured, and the uncommitted changes to the code under it (a shared working tree)."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": git("status", "--porcelain", "--", "../hpcrl").splitlines()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one size, few steps, one repeat (< 90 s)")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "hf_detached.json"))
    ap.add_argument("--wait-load", type=float, default=2.5, help="wait while the 1-min load average is above this")
    ap.add_argument("--wait-max", type=float, default=None, help="longest such wait, s (default 120; quick 0)")
    args = ap.parse_args()
    quick = args.quick
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hpcrl.comm import spawn

    p: dict[str, Any] = {
        "sizes": [64] if quick else [64, 256, 512], "ratio_hidden": 64 if quick else 256, "layers": 2,
        "max_prompt_tokens": 8, "max_new_tokens": 32, "batch_size": 16, "epochs": 1, "minibatches": 1,
        "steps": {64: 20} if quick else {64: 30, 256: 30, 512: 16}, "repeats": 1 if quick else 4,
        "makers": 1, "trainers": 1, "torch_threads_per_rank": 1, "ranks": 2, "reward_fn": REWARD,
        "setup": "2 processes (1 maker : 1 trainer), 1 torch thread each, on a machine of "
                 f"{os.cpu_count()} cores; gloo on loopback; CPU",
    }
    info = machine_info("cpu", 1)
    info["git"] = git_state()
    info["wait"] = pt.wait_quiet(args.wait_load, args.wait_max if args.wait_max is not None else (0 if quick else 120))
    info["loadavg_start"] = loadavg()
    t_start = time.perf_counter()
    print(f"hf_detached: {info['cpu_model']}, {info['cpu_count']} cpus, torch {info['torch']}, 1 thread/rank, "
          f"load {info['loadavg_start']}" + (" [quick]" if quick else ""), flush=True)
    tmp = tempfile.mkdtemp(prefix="hf-detached-")
    try:
        import hf_fixtures as F

        prompts = str(F.write_prompts(Path(tmp) / "prompts.jsonl"))
        models = {h: build_llama(Path(tmp) / f"llama{h}", h) for h in p["sizes"]}
        jobs = [{"kind": "ppo", "key": (h, lag), "cfg": hf_cfg(models[h]["dir"], prompts, p, lag, p["steps"][h],
                                                                 os.path.join(tmp, f"run{r}-{h}-{lag}"))}
                for r in range(p["repeats"]) for h in p["sizes"] for lag in (1, 0)]
        print(f"spawning 2 ranks for {len(jobs)} runs ...", flush=True)
        per_rank = spawn(pt.rank_worker, 2, args=(jobs,), timeout_s=900, env={"HF_HUB_OFFLINE": "1"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw: dict[tuple, list[dict]] = {}
    for j, job in enumerate(jobs):
        res = analyse([per_rank[0][j], per_rank[1][j]])
        raw.setdefault(job["key"], []).append(res)
        h, lag = job["key"]
        print(f"  hidden {h:4d} lag {lag}: {res['tokens_per_s']:7.0f} tok/s, {res['ms_per_step']:6.1f} ms/step, "
              f"collect {res['collect_ms']:.0f} ms, trainer busy {res['update_ms']:.0f} ms, trainer idle "
              f"{pt.fmt_pct(res['trainer_idle'])}, maker idle {pt.fmt_pct(res['maker_idle'])}, lag mean "
              f"{res['lag_mean']:.2f}, publish {res['publish_ms']:.1f} ms, run {res['run_s']:.1f} s", flush=True)

    sizes = {}
    for h in p["sizes"]:
        a, b = raw[(h, 1)], raw[(h, 0)]
        each = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b)]
        s1, s0 = summary(a), summary(b)
        c, u = s0["collect_ms"], s0["update_ms"]  # lag 0: each phase alone on the machine
        sizes[h] = {"lag1": s1, "lag0": s0, "lag1_over_lag0": statistics.median(each),
                    "lag1_over_lag0_each": each, "ideal_from_lag0_phases": (c + u) / max(c, u)}
    rh = p["ratio_hidden"]
    r = sizes[rh]
    ratio = {"hidden": rh, "params_mib": models[rh]["param_bytes"] / MiB, "lag1_over_lag0": r["lag1_over_lag0"],
             "lag1_over_lag0_each": r["lag1_over_lag0_each"], "ideal": r["ideal_from_lag0_phases"],
             "lag1": r["lag1"], "lag0": r["lag0"]}
    publish = [{"hidden": h, "params": models[h]["params"], "param_bytes": models[h]["param_bytes"],
                "params_mib": models[h]["param_bytes"] / MiB, "publish_nbytes": s["lag1"]["runs"][0]["publish_nbytes"],
                "publish_ms_median": s["lag1"].get("publish_ms"), "publish_ms_median_lag0": s["lag0"].get("publish_ms"),
                "tokens_per_s": s["lag1"]["tokens_per_s"], "tokens_per_s_lag0": s["lag0"]["tokens_per_s"],
                "lag1_over_lag0": s["lag1_over_lag0"], "collect_ms_lag0": s["lag0"]["collect_ms"],
                "update_ms_lag0": s["lag0"]["update_ms"], "ideal_ratio": s["ideal_from_lag0_phases"]}
               for h, s in sizes.items()]
    info["loadavg_end"] = loadavg()
    payload = {"benchmark": "hf_detached", "quick": quick, "machine": info, "params": p, "ratio": ratio,
               "publish": publish, "seconds": {"total": round(time.perf_counter() - t_start, 1)}}

    print_table(f"detached PPO, --workload hf, 1 maker : 1 trainer, 1 thread each (median of {p['repeats']})",
                ["hidden", "MiB", "lag", "tok/s", "ms/step", "collect ms", "trainer busy ms", "trainer idle",
                 "maker idle", "lag mean", "publish ms", "lag1/lag0", "ideal"],
                [[h, f"{models[h]['param_bytes'] / MiB:.2f}", lag, f"{s[k]['tokens_per_s']:.0f}",
                  f"{s[k]['ms_per_step']:.0f}", f"{s[k]['collect_ms']:.0f}", f"{s[k]['update_ms']:.0f}",
                  pt.fmt_pct(s[k].get("trainer_idle")), pt.fmt_pct(s[k].get("maker_idle")),
                  f"{s[k]['lag_mean']:.2f}", f"{s[k].get('publish_ms', float('nan')):.2f}",
                  f"{s['lag1_over_lag0']:.2f}x" if lag else "", f"{s['ideal_from_lag0_phases']:.2f}x" if lag else ""]
                 for h, s in sizes.items() for lag, k in ((1, "lag1"), (0, "lag0"))])
    print(f"\nratio at hidden {rh}: lag 1 / lag 0 = {ratio['lag1_over_lag0']:.2f}x (each: "
          f"{', '.join(f'{x:.2f}' for x in ratio['lag1_over_lag0_each'])}; ideal from the lag-0 phases "
          f"{ratio['ideal']:.2f}x); load {info['loadavg_start']} -> {info['loadavg_end']}; "
          f"{payload['seconds']['total']} s")
    write_json(args.json, pt._nan_to_none(payload))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
