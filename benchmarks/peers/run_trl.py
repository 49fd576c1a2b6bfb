#!/usr/bin/env python
"""TRL's ``GRPOTrainer`` on the hf learning benchmark's task: the peer of ``benchmarks/hf/hf_learning.py``.

Run in TRL's own venv (``bash tools/trl_venv.sh`` makes ``.venv-trl``), as a process of its own:

    .venv-trl/bin/python benchmarks/peers/run_trl.py --demo DIR --json OUT.json [--steps 200 ...]

``DIR`` is what ``python -m hpcrl.ppo.demo DIR`` built (``model/``, ``prompts.jsonl``, ``eval.jsonl``).
Only TRL's public API is used: ``GRPOConfig``, ``GRPOTrainer(model=DIR/model, reward_funcs=[checker],
train_dataset=...)``, and a ``TrainerCallback`` that records TRL's own per-step logs (``reward``,
``completions/mean_length``) with the wall time, and scores the greedy actor on ``eval.jsonl`` every
``--eval-every`` updates with the same checker as hpcrl's ``--hf.eval-prompts`` (mean reward; pass =
score >= 1.0). The budget matches hpcrl's run: ``--batch-size`` prompts x ``--group-size`` samples
per update (``per_device_train_batch_size`` = their product, one optimizer step per generation batch),
``--max-new-tokens`` (``max_completion_length``). The checker is ``hpcrl.ppo.demo_task.reward``, loaded
from its file (hpcrl itself is not installed in this venv). The JSON has hf_learning's run format.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # process start: imports (torch, transformers, trl) count in the wall time

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _task():
    """hpcrl.ppo.demo_task by path: pure Python at import (no hpcrl package, no C extension)."""
    spec = importlib.util.spec_from_file_location("demo_task", REPO / "hpcrl" / "ppo" / "demo_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TASK = _task()


def checker(prompts: list[str], completions: list[str], answer: list[list[str]], **_: Any) -> list[float]:
    """TRL reward function: the dataset's ``answer`` column arrives as a keyword argument."""
    return TASK.reward([{"answer": a} for a in answer], completions)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def greedy_eval(model: Any, tok: Any, records: list[dict[str, Any]], max_new_tokens: int) -> dict[str, float]:
    """Mean greedy reward and pass rate (score >= 1.0) on ``records``: hpcrl's eval rows' definition."""
    import torch

    was_training = model.training
    model.eval()
    side, tok.padding_side = tok.padding_side, "left"
    batch = tok([r["prompt"] for r in records], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    tok.padding_side = side
    answers = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = TASK.reward(records, answers)
    model.train(was_training)
    return {"eval_reward": sum(scores) / len(scores), "eval_pass_rate": sum(s >= 1.0 for s in scores) / len(scores)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, required=True, help="a dir written by python -m hpcrl.ppo.demo")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200, help="updates (optimizer steps, one per generation batch)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per update")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt (num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6, help="learning_rate (TRL's GRPO default 1e-6)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL's default 0.0)")
    ap.add_argument("--epsilon", type=float, default=0.2, help="clip (TRL's default 0.2)")
    ap.add_argument("--num-iterations", type=int, default=1, help="passes per batch (TRL's default 1)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--loss-type", default="dapo", help="TRL's default dapo")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (hpcrl's runs: 1 per rank)")
    args = ap.parse_args()
    for name in ("model", "prompts.jsonl", "eval.jsonl"):
        if not (args.demo / name).exists():
            print(f"run_trl: error: {args.demo / name} missing; pass --demo DIR built by python -m hpcrl.ppo.demo DIR",
                  file=sys.stderr)
            return 2

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    records = read_jsonl(args.demo / "prompts.jsonl")
    held_out = read_jsonl(args.demo / "eval.jsonl")
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    n = args.batch_size * args.group_size
    out_dir = args.json.parent / f".trl-{args.json.stem}"
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, learning_rate=args.lr, beta=args.beta,
        epsilon=args.epsilon, num_iterations=args.num_iterations, temperature=args.temperature,
        loss_type=args.loss_type, num_generations=args.group_size, per_device_train_batch_size=n,
        gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=args.max_new_tokens,
        # CPU, fp32, no activation recomputation: what hpcrl's trainer runs (TRL defaults bf16 and
        # gradient checkpointing on); constant lr as hpcrl's
        bf16=False, fp16=False, gradient_checkpointing=False, lr_scheduler_type="constant", warmup_steps=0,
        use_cpu=True, logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, data_seed=args.seed,
        disable_dropout=True, dataloader_num_workers=0,
    )

    curve: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    state: dict[str, float] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, a, s, c, **kw):
            # update 0 scored before the clock starts (hpcrl's first eval row is at --eval-every)
            e = greedy_eval(kw["model"], kw["processing_class"], held_out, args.max_new_tokens)
            evals.append({"update": 0, "time_s": 0.0, **e})
            state["t_train"] = time.perf_counter()

        def on_log(self, a, s, c, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            tokens = logs.get("completions/mean_length", float("nan")) * n
            curve.append({"update": s.global_step, "time_s": time.perf_counter() - state["t_train"],
                          "reward": logs["reward"], "tokens": tokens, "entropy": logs.get("entropy")})

        def on_step_end(self, a, s, c, **kw):
            # in the clock, as hpcrl's trainer-side eval is in its rows' time
            if s.global_step % args.eval_every == 0 or s.global_step == args.steps:
                e = greedy_eval(kw["model"], kw["processing_class"], held_out, args.max_new_tokens)
                evals.append({"update": s.global_step, "time_s": time.perf_counter() - state["t_train"], **e})

    trainer = GRPOTrainer(model=str(args.demo / "model"), reward_funcs=[checker], args=config, train_dataset=train,
                          callbacks=[Record()])
    t_setup = time.perf_counter() - T0
    trainer.train()
    wall = time.perf_counter() - T0
    tokens = sum(r["tokens"] for r in curve)
    train_s = curve[-1]["time_s"] if curve else float("nan")
    out = {"system": "trl-grpo", "seed": args.seed, "versions": {"trl": trl.__version__,
           "transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version()},
           "config": {**{k: v for k, v in vars(args).items() if k not in ("demo", "json")}, "samples_per_update": n},
           "curve": curve, "eval": evals, "setup_s": t_setup, "process_wall_s": wall, "train_s": train_s,
           "tokens": tokens, "tokens_per_s": tokens / train_s if train_s else float("nan"),
           "loadavg_end": os.getloadavg()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"run_trl: {len(curve)} updates in {train_s:.1f} s (process {wall:.1f} s), reward "
          f"{curve[0]['reward']:.3f} -> {curve[-1]['reward']:.3f}, eval pass {evals[0]['eval_pass_rate']:.2f} -> "
          f"{evals[-1]['eval_pass_rate']:.2f}; {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
