"""``python -m hpcrl.ppo.demo DIR``: everything ``--workload hf`` needs, built locally (nothing downloads),
and the command that trains on it.

``DIR/model``: a 2-layer, hidden-64 Llama (``LlamaForCausalLM``, ``save_pretrained``) with a word-level
tokenizer, pre-trained for a few seconds on the answer *format* of the list task
(:mod:`hpcrl.ppo.demo_task`); ``DIR/prompts.jsonl``: records such as ``{"prompt": "list: cat dog",
"answer": ["bird", "fish", "horse", "cow"]}``, and ``DIR/eval.jsonl``, a held-out set of them; the
reward is :func:`reward` (``--hf.reward-fn hpcrl.ppo.demo:reward``, a records reward): the share of the
response's first three words that are words of the record's answer. The printed command evaluates
the greedy actor on ``eval.jsonl`` every 50 updates (``eval_reward`` / ``eval_pass_rate`` rows). A
pre-trained policy answers with words of any category (score ~0.1); the printed command (400 PPO
updates, about a minute on 2 cores) raises it to ~0.9.
``--engine vllm`` builds the model with attention heads of 32 features (vLLM's CPU attention runs none
smaller; the default's are 16) and prints the command with ``--hf.engine vllm``.
``python -m hpcrl.ppo.demo --show MODEL_DIR`` prints a model's greedy answers and their scores (the
demo's ``DIR/model`` before training, ``RUN_DIR/hf/actor`` after).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from .demo_task import (CATEGORIES, build_causal_lm, format_corpus, greedy_answers, reward, task_prompts, task_record,
                        write_records)

__all__ = ["build", "command", "main", "refusal", "reward"]

PROG = "hpcrl.ppo.demo"
TRAIN_ARGS = ("--hf.max-prompt-tokens", "3", "--hf.max-new-tokens", "4", "--hf.batch-size", "64",
              "--ppo.lr", "1e-3", "--ppo.kl-coef", "0.01", "--makers", "1", "--trainers", "1")
"""Sizes and hyper-parameters the printed command passes (measured to learn in a few minutes on 2 cores)."""


EVAL_RECORDS = 48
EVAL_EVERY = 50


ENGINE_HEAD_DIM = {"hf": None, "vllm": 32}
"""The demo model's attention head size per engine (None: hidden / heads = 16, what the figures were measured with)."""


def build(out: Path, seed: int = 0, pretrain_steps: int = 300, prompts: int = 256,
          engine: str = "hf") -> tuple[Path, Path, Path]:
    """``(model dir, prompts file, eval file)`` written under ``out``, the model one ``engine`` runs."""
    out.mkdir(parents=True, exist_ok=True)
    build_causal_lm(out / "model", format_corpus(2000, seed + 1), seed=seed, pretrain_steps=pretrain_steps,
                    head_dim=ENGINE_HEAD_DIM[engine])
    return (out / "model", write_records(out / "prompts.jsonl", task_prompts(prompts, seed)),
            write_records(out / "eval.jsonl", task_prompts(EVAL_RECORDS, seed + 1000)))


def command(out: Path, total_steps: int = 400, run_dir: str = "runs/hf", python: str | None = None,
            engine: str = "hf") -> list[str]:
    """The ``python -m hpcrl.ppo`` command line that trains on the demo in ``out``."""
    return [python or _python(), "-m", "hpcrl.ppo", "--workload", "hf", "--hf.model", str(out / "model"),
            "--hf.reward-fn", "hpcrl.ppo.demo:reward", "--hf.prompts", str(out / "prompts.jsonl"),
            "--hf.eval-prompts", str(out / "eval.jsonl"), "--hf.eval-every", str(EVAL_EVERY), *TRAIN_ARGS,
            *(("--hf.engine", engine) if engine != "hf" else ()), "--total-steps", str(total_steps), "--run-dir", run_dir]


def show(model_dir: str) -> float:
    """Print the greedy answer of ``model_dir`` (the demo's model, or a trained RUN_DIR/hf/actor) to one
    prompt per category with its score; returns the mean score."""
    prompts = task_prompts(len(CATEGORIES), seed=7)
    answers = greedy_answers(model_dir, prompts)
    scores = reward([task_record(p, i) for i, p in enumerate(prompts)], answers)
    for p, a, s in zip(prompts, answers, scores):
        print(f"{p} -> {a}  (score {s:.2f})")
    mean = sum(scores) / len(scores)
    print(f"mean score {mean:.2f} over {len(scores)} prompts (greedy)")
    return mean


def _python() -> str:
    """This interpreter, relative when under the working directory (``.venv/bin/python``, as the README
    spells it)."""
    exe = sys.executable
    return os.path.relpath(exe) if os.path.abspath(exe).startswith(os.getcwd() + os.sep) else exe


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("dir", type=Path, nargs="?",
                   help="where to write model/, prompts.jsonl and eval.jsonl (must not hold them)")
    p.add_argument("--show", metavar="MODEL_DIR", default=None,
                   help="instead: print a model's greedy answers and scores, e.g. RUN_DIR/hf/actor after training")
    p.add_argument("--seed", type=int, default=0, help="model init, pre-training and prompts (default: 0)")
    p.add_argument("--engine", choices=sorted(ENGINE_HEAD_DIM), default="hf",
                   help="the makers' engine the model is built for and the command uses (vllm: heads of 32 "
                        "features, which vLLM's CPU attention runs; default: hf)")
    p.add_argument("--pretrain-steps", type=int, default=300,
                   help="format pre-training steps, batch 64 (0: a random model; default: 300, a few seconds)")
    return p.parse_args(argv)


def _quiet() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" / "Loading weights" bars
    transformers.utils.logging.set_verbosity_error()


def refusal(argv: list[str]) -> str | None:
    """Why :func:`main` would refuse ``argv`` (one line), or None: the checks made before anything is built."""
    return _refusal(_parse(argv))


def _refusal(args: argparse.Namespace) -> str | None:
    if (args.dir is None) == (args.show is None):
        return "pass DIR (build the demo there) or --show MODEL_DIR, not both or neither"
    if args.show is not None:
        ok = (Path(args.show) / "config.json").is_file()
        return None if ok else f"--show {args.show}: no config.json there; pass DIR/model or RUN_DIR/hf/actor"
    taken = [p for p in (args.dir / "model", args.dir / "prompts.jsonl", args.dir / "eval.jsonl") if p.exists()]
    if taken:
        return f"{taken[0]} already exists; pass a new DIR (the demo never overwrites files)"
    if args.pretrain_steps < 0:
        return f"--pretrain-steps {args.pretrain_steps}: must be >= 0, e.g. 300"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    refusal = _refusal(args)
    if refusal is not None:
        print(f"{PROG}: error: {refusal}", file=sys.stderr)
        return 2
    _quiet()
    if args.show is not None:
        show(args.show)
        return 0
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, prompts, held_out = build(args.dir, args.seed, args.pretrain_steps, engine=args.engine)
    py = _python()
    heads = "" if ENGINE_HEAD_DIM[args.engine] is None else f", heads of {ENGINE_HEAD_DIM[args.engine]}"
    print(f"{PROG}: wrote {model} (Llama, 2 layers, hidden 64{heads}), {prompts} and {held_out} (held out)")
    print(f"{PROG}: greedy answers before / after training: {py} -m {PROG} --show {model} | --show runs/hf/hf/actor")
    print(f"{PROG}: train with:")
    print(shlex.join(command(args.dir, python=py, engine=args.engine)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
