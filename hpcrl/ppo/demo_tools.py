"""A tool-use task for the ``hf`` workload's multi-turn episodes (``--hf.tools``), built locally (nothing
downloads): ``sum A B`` asks for A + B, which a tiny model cannot work out, but the ``add`` tool can.

* records ``{"prompt": "sum 12 30", "answer": 42, "id": 0}`` with A, B in ``range(NUMBERS)``; the held-out
  records (:func:`split_pairs`) are pairs whose unordered pair ``{A, B}`` never occurs in the training
  records, so neither order of a held-out sum was ever a training prompt;
* the tool :func:`add` (``--hf.tools hpcrl.ppo.demo_tools:add``): ``"12 30"`` -> ``"42"``; anything but two
  integers raises ValueError (the policy then sees ``<error> ... </error>``);
* the reward :func:`reward` (a records reward, ``--hf.reward-fn hpcrl.ppo.demo_tools:reward``): 1.0 when the
  answer's last word is the record's answer, else 0.0;
* :func:`build`: a 2-layer, hidden-64 Llama (:func:`~hpcrl.ppo.demo_task.tiny_config`) with a word-level
  tokenizer that holds every number word up to ``2 * (NUMBERS - 1)`` and the tags, pre-trained briefly on
  the *format* only (:func:`format_corpus`). An episode that uses the tool reads::

      sum 12 30 | <tool> add 12 30 </tool> <eos> | <result> 42 </result> | 42 <eos>
      prompt    | the policy's first turn        | the observation       | the answer

  Pre-training sees such transcripts for :data:`TOOL_SHARE` of its lines and direct answers ``sum A B X
  <eos>`` (X a random number) for the rest; in a transcript the answer is A or B more often than the
  result (:data:`ANSWER_MIX`). The loss counts the policy's tokens only (:func:`pretrain_policy_tokens`):
  never the prompt nor the observation, so the model is never trained to predict a sum. The pre-trained
  policy samples a tool call on part of the episodes and then answers with the wrong number of the
  conversation most of the time; RL must learn to call the tool and to copy its result;
* :func:`command`: the ``python -m hpcrl.ppo`` command line of the with-tool run, or (``tools=False``) of the
  baseline: the same model, records and budget with ``--hf.max-turns 1`` and no tool, which must answer the
  held-out sums directly.

``python -m hpcrl.ppo.demo_tools DIR`` builds the task in DIR and prints both commands;
``benchmarks/hf/tool_learning.py`` runs them and plots the learning curves.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
from pathlib import Path
from typing import Any, NamedTuple

from .demo_task import build_tokenizer, tiny_config

__all__ = ["Built", "add", "build", "command", "format_corpus", "play", "reward", "split_pairs", "task_records"]

PROG = "hpcrl.ppo.demo_tools"
NUMBERS = 50
"""A and B are drawn from ``range(NUMBERS)``; sums reach ``2 * (NUMBERS - 1)``."""
ASK, TOOL = "sum", "add"
CALL, END_CALL = "<tool>", "</tool>"
RESULT, END_RESULT, ERROR, END_ERROR = "<result>", "</result>", "<error>", "</error>"
EOS = "<eos>"
PROMPT_TOKENS = 3  # "sum A B"
TOOL_SHARE = 0.5
"""The share of pre-training lines that call the tool (the rest answer directly)."""
ANSWER_MIX = (("a", 0.4), ("b", 0.4), ("sum", 0.2))
"""What a pre-training transcript answers after the result: A or B (greedy picks one of them), or the result."""
PRETRAIN_BATCH = 64
PRETRAIN_STEPS = 1000
"""Format pre-training steps of :func:`build` (batch 64, about 20 s on one core)."""
EVAL_RECORDS = 64
TRAIN_RECORDS = 1024
EVAL_EVERY = 10
STEPS = 300
"""Updates of the printed commands (about 1.5 min with the tool, 30 s without, on 2 quiet cores)."""
TRAIN_ARGS = ("--hf.max-prompt-tokens", str(PROMPT_TOKENS), "--hf.max-new-tokens", "6", "--hf.algo", "grpo",
              "--hf.group-size", "8", "--hf.batch-size", "16", "--ppo.lr", "1e-3", "--ppo.epochs", "2",
              "--ppo.minibatches", "2", "--makers", "1", "--trainers", "1", "--checkpoint-every", "0")
"""Sizes and hyper-parameters both runs pass (GRPO, 16 prompts x 8 episodes per update)."""
TOOL_ARGS = ("--hf.tools", f"{TOOL}={PROG}:add", "--hf.max-turns", "2", "--hf.max-episode-tokens", "12",
             "--hf.tool-timeout-s", "10")
"""What the with-tool run adds: the tool, two turns (call, then answer), 12 tokens after the prompt."""


class Built(NamedTuple):
    """What :func:`build` wrote."""

    model: Path
    train: Path
    eval: Path


# ---------------------------------------------------------------------------- the tool and the reward


def add(argument: str) -> str:
    """The tool: ``"12 30"`` -> ``"42"``; ValueError unless the argument is two integers."""
    words = argument.split()
    if len(words) != 2:
        raise ValueError(f"add takes two integers, got {argument!r}")
    try:
        a, b = (int(w) for w in words)
    except ValueError:
        raise ValueError(f"add takes two integers, got {argument!r}") from None
    return str(a + b)


def last_word(response: str) -> str:
    words = response.split()
    return words[-1] if words else ""


def reward(records: list[dict[str, Any]], responses: list[str]) -> list[float]:
    """The ``--hf.reward-fn`` (a records reward): 1.0 when a response's last word is its record's answer."""
    return [float(last_word(r) == str(rec["answer"])) for rec, r in zip(records, responses)]


# ---------------------------------------------------------------------------- records


def split_pairs(seed: int = 0, eval_records: int = EVAL_RECORDS) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(training pairs, held-out pairs)``: every ordered pair of ``range(NUMBERS)``, the held-out ones
    ``eval_records`` pairs whose unordered pair (either order) is in no training pair."""
    rng = random.Random(seed)
    unordered = [(a, b) for a in range(NUMBERS) for b in range(a, NUMBERS)]
    rng.shuffle(unordered)
    held: list[tuple[int, int]] = []
    for a, b in unordered[:eval_records]:
        held.append((a, b) if rng.random() < 0.5 else (b, a))
    train = sorted(p for a, b in unordered[eval_records:] for p in {(a, b), (b, a)})
    return train, held


def task_records(pairs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """One record per pair: ``{"prompt": "sum A B", "answer": A + B, "id": i}``."""
    return [{"prompt": f"{ASK} {a} {b}", "answer": a + b, "id": i} for i, (a, b) in enumerate(pairs)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the format and pre-training


def transcript(a: int, b: int, answer: int | str, tool: bool = True) -> str:
    """An episode as text: with the tool, the call, its result and the answer; else the direct answer."""
    if not tool:
        return f"{ASK} {a} {b} {answer} {EOS}"
    result = add(f"{a} {b}")
    return f"{ASK} {a} {b} {CALL} {TOOL} {a} {b} {END_CALL} {EOS} {RESULT} {result} {END_RESULT} {answer} {EOS}"


def format_corpus(pairs: list[tuple[int, int]], n: int, seed: int = 1) -> list[str]:
    """``n`` pre-training lines over ``pairs``: :data:`TOOL_SHARE` of them transcripts with the tool whose
    answer follows :data:`ANSWER_MIX`, the rest direct answers with a random number: the format, not the task."""
    rng = random.Random(seed)
    kinds, weights = zip(*ANSWER_MIX)
    lines = []
    for _ in range(n):
        a, b = rng.choice(pairs)
        guess = rng.randrange(2 * NUMBERS - 1)
        if rng.random() >= TOOL_SHARE:
            lines.append(transcript(a, b, guess, tool=False))
            continue
        pick = rng.choices(kinds, weights)[0]
        lines.append(transcript(a, b, {"a": a, "b": b, "sum": a + b}[pick]))
    return lines


def vocabulary() -> list[str]:
    """Every word an episode can hold: the prompt word, the numbers up to the largest sum, the tool and tags."""
    return [ASK, TOOL, CALL, END_CALL, RESULT, END_RESULT, ERROR, END_ERROR] + [str(i) for i in range(2 * NUMBERS - 1)]


def policy_mask(ids: list[int], tok: Any) -> list[bool]:
    """Per token of a transcript: whether the policy writes it (not the prompt's, not an observation's)."""
    opens = {tok.convert_tokens_to_ids(t) for t in (RESULT, ERROR)}
    closes = {tok.convert_tokens_to_ids(t) for t in (END_RESULT, END_ERROR)}
    out, inside = [], False
    for k, t in enumerate(ids):
        inside = inside or t in opens
        out.append(k >= PROMPT_TOKENS and not inside)
        inside = inside and t not in closes
    return out


def pretrain_policy_tokens(model: Any, tok: Any, corpus: list[str], steps: int, seed: int = 0, batch: int = 64,
                           lr: float = 3e-3) -> float:
    """Next-token training on ``corpus`` transcripts (``<eos>`` inside a line is the EOS token), ``batch`` lines
    a step taken in order (a corpus of ``steps * batch`` lines is seen once: no line's answer is memorised),
    with the loss on the policy's tokens only (:func:`policy_mask`); returns the last loss."""
    import torch

    rows = [list(tok(line, add_special_tokens=False)["input_ids"]) for line in corpus]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([[t if m else -100 for t, m in zip(r, policy_mask(r, tok))] + [-100] * (width - len(r))
                           for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    model.train()
    loss = torch.zeros(())
    for step in range(steps):
        pick = torch.arange(step * batch, (step + 1) * batch) % len(rows)
        loss = model(input_ids=ids[pick], attention_mask=attn[pick], labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def build(out: Path, seed: int = 0, pretrain_steps: int = PRETRAIN_STEPS) -> Built:
    """The model (``out/model``), training records (``out/train.jsonl``) and held-out records
    (``out/eval.jsonl``), written under ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = split_pairs(seed)
    rng = random.Random(seed)
    tok = build_tokenizer(out / "model", [" ".join(vocabulary())])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok), tok.eos_token_id, max_positions=64))
    if pretrain_steps:
        pretrain_policy_tokens(model, tok, format_corpus(train, pretrain_steps * PRETRAIN_BATCH, seed + 1),
                               pretrain_steps, seed, PRETRAIN_BATCH)
    model.save_pretrained(out / "model")
    return Built(out / "model", write_jsonl(out / "train.jsonl", task_records(rng.sample(train, TRAIN_RECORDS))),
                 write_jsonl(out / "eval.jsonl", task_records(held)))


def command(built: Built, tools: bool = True, total_steps: int = STEPS, run_dir: str | Path = "runs/hf-tools",
            seed: int = 0, eval_every: int = EVAL_EVERY, python: str | None = None) -> list[str]:
    """The ``python -m hpcrl.ppo`` command of the with-tool run, or (``tools=False``) of the no-tool baseline
    (the same model, records and budget, one turn: it must answer directly)."""
    cmd = [python or sys.executable, "-m", "hpcrl.ppo", "--workload", "hf", "--hf.model", str(built.model),
           "--hf.reward-fn", f"{PROG}:reward", "--hf.prompts", str(built.train),
           "--hf.eval-prompts", str(built.eval), "--hf.eval-every", str(eval_every), *TRAIN_ARGS]
    cmd += list(TOOL_ARGS) if tools else ["--hf.max-turns", "1"]
    return cmd + ["--total-steps", str(total_steps), "--seed", str(seed), "--run-dir", str(run_dir)]


# ---------------------------------------------------------------------------- greedy episodes, played here


def play(model_dir: str | Path, records: list[dict[str, Any]], tools: bool = True, max_new_tokens: int = 6,
         max_turns: int = 2, episode_tokens: int = 12) -> list[tuple[str, float]]:
    """``(transcript, reward)`` of each record's greedy episode, played as the runs' evaluation plays it (the
    tool called in this process; one turn without ``tools``): the untrained model's update-0 pass rate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .workloads.hf_env import CALL as CALL_PATTERN

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos, out = tok.eos_token_id, []
    for rec in records:
        ctx = list(tok(rec["prompt"], add_special_tokens=False)["input_ids"])
        start, score = len(ctx), 0.0
        for _ in range(max_turns if tools else 1):
            x, room = torch.tensor([ctx]), episode_tokens - (len(ctx) - start)
            with torch.no_grad():
                gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos, max_new_tokens=min(max_new_tokens, room))
            new = gen[0, len(ctx):].tolist()
            ctx += new
            text = tok.decode(new, skip_special_tokens=True)
            call = CALL_PATTERN.search(text) if tools else None
            if call is None:
                score = reward([rec], [text])[0]
                break
            obs = observe(call.group(1), call.group(2))
            ids = list(tok(obs, add_special_tokens=False)["input_ids"])
            if len(ctx) - start + len(ids) >= episode_tokens:
                break
            ctx += ids
        out.append((tok.decode(ctx), score))
    return out


def observe(name: str, argument: str) -> str:
    """What a call shows the policy (as ``--hf.tools`` episodes do): the result, or the error."""
    try:
        if name != TOOL:
            raise ValueError(f"no tool named {name!r}")
        return f"{RESULT} {add(argument)} {END_RESULT}"
    except ValueError as err:
        return f"{ERROR} ValueError: {err} {END_ERROR}"


# ---------------------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("dir", type=Path, help="where to write model/, train.jsonl and eval.jsonl (must not hold them)")
    p.add_argument("--seed", type=int, default=0, help="model init, pre-training and records (default: 0)")
    p.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS,
                   help=f"format pre-training steps, batch 64 (default: {PRETRAIN_STEPS})")
    args = p.parse_args(argv)
    taken = [q for q in (args.dir / "model", args.dir / "train.jsonl", args.dir / "eval.jsonl") if q.exists()]
    if taken or args.pretrain_steps < 0:
        why = f"{taken[0]} already exists; pass a new DIR" if taken else "--pretrain-steps must be >= 0"
        print(f"{PROG}: error: {why}", file=sys.stderr)
        return 2
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    built = build(args.dir, args.seed, args.pretrain_steps)
    py = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + os.sep) else sys.executable
    print(f"{PROG}: wrote {built.model}, {built.train} and {built.eval} (held out)")
    print(f"{PROG}: with the tool:")
    print(shlex.join(command(built, True, python=py, run_dir="runs/hf-tools")))
    print(f"{PROG}: the baseline without it:")
    print(shlex.join(command(built, False, python=py, run_dir="runs/hf-no-tools")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
